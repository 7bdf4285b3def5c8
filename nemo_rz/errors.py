"""Errors that the command line reports as one line and an exit code, never as a traceback.

Bad input (config, data, checkpoints, model files) is a ValueError: exit code 2. ConfigError is the
configuration's own kind. Numerical divergence during training is not bad input: DivergenceError, exit 3.
Ctrl-C is exit 130; SIGTERM (what a scheduler sends to stop a job) unwinds the same way, as Terminated: exit 143.
"""
from __future__ import annotations

import argparse

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130  # the shell's code for SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM, the shell's code for a process ended by SIGTERM


class ConfigError(ValueError):
    """A configuration key has a wrong type or value, or cannot change on resume."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: stop like Ctrl-C (workers and ranks stopped, the last checkpoint kept)."""


class DivergenceError(RuntimeError):
    """Training diverged: a non-finite or exploding loss, gradient norm or weight."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse raising ConfigError for a bad argument (instead of printing the usage text, then the error), and
    taking options and positional arguments (`key=value` overrides) in any order."""

    def parse_args(self, args=None, namespace=None):
        return self.parse_intermixed_args(args, namespace)

    def error(self, message):
        raise ConfigError(f"{message} (see {self.prog} --help)")
