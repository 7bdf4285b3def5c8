"""Command-line tools: check_mismatch, bisect, report."""
