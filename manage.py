#!/usr/bin/env python
"""Django's command-line utility for Temper."""

import os
import sys


def main() -> None:
    if sys.argv[1:2] == ["up"] and "--role" not in sys.argv:  # a supervisor: Ctrl-C is recorded from here on
        from webapp.common import early_signals

        early_signals.install()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
