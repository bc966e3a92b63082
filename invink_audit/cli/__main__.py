import sys

from invink_audit.cli import console_main

sys.exit(console_main())
