"""The errors the command line reports as one line and an exit code, never as a traceback; every module raises
these (or ValueError, for bad input a caller passes in code).

- Bad input (config, data, checkpoints, model files, a run directory): BadInput and its kinds, all ValueErrors:
  exit 2. Nothing already written is lost.
- Divergence (a non-finite or exploding loss, gradient norm or weight; a non-finite importance ratio; a -inf or
  NaN learner logprob): DivergenceError, exit 3. The last good checkpoint is kept.
- Rollout workers that keep failing (crash loops, hung workers past the restart budget): WorkerFailed, exit 4.
- Ctrl-C is exit 130; SIGTERM (what a scheduler sends to stop a job) unwinds the same way, as Terminated: exit 143.
"""
from __future__ import annotations

import argparse

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_WORKER_FAILED = 4
EXIT_INTERRUPTED = 130  # the shell's code for SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM, the shell's code for a process ended by SIGTERM


class BadInput(ValueError):
    """Something the user supplied cannot be used: one line saying what, where and what to do (exit 2)."""

    def __init__(self, message: str = ""):
        super().__init__(" ".join(str(message).split()))  # one line, whatever the parts it was built from


class ConfigError(BadInput):
    """A configuration key has a wrong type or value, or cannot change on resume."""


class OptionError(ConfigError):
    """A task option (`task.options.*`) has a wrong type or value."""


class PluginError(BadInput):
    """A named plugin (correction, loss, task, verifier) is unknown, or failed to load."""


class ModelFileError(BadInput):
    """A model file or directory is missing, unreadable or does not fit."""


class CorruptCheckpoint(BadInput):
    """A checkpoint is damaged, incomplete or not this run's."""


class RunDirInUse(BadInput):
    """Another trainer holds the run directory."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: stop like Ctrl-C (workers and ranks stopped, the last checkpoint kept)."""


class DivergenceError(RuntimeError):
    """Training diverged: a non-finite or exploding loss, gradient norm or weight (exit 3)."""


class NonFiniteRatioError(DivergenceError, ValueError):
    """A valid token has an inf/nan importance ratio (or log-ratio): divergence (exit 3). Also a ValueError, as
    it always was, for library callers (NeMo RL's loop) that catch it as one."""


class NeMoRLVersionError(RuntimeError):
    """A NeMo RL whose Megatron setup nemo-rz cannot hook (runtime/megatron/nemo_rl_policy.py); one line."""


class WorkerFailed(RuntimeError):
    """Rollout workers keep failing (exit 4); the message holds the worker's last error."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse raising ConfigError for a bad argument (instead of printing the usage text, then the error), and
    taking options and positional arguments (`key=value` overrides) in any order."""

    def parse_args(self, args=None, namespace=None):
        return self.parse_intermixed_args(args, namespace)

    def error(self, message):
        raise ConfigError(f"{message} (see {self.prog} --help)")
