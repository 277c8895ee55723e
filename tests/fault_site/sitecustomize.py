"""Imported by every Python process started with this folder on PYTHONPATH (the tests' fault
injection, tests/fault_injection.py): installs the fault that MESHLOOM_FAULT names."""

import os
import sys

if os.environ.get("MESHLOOM_FAULT"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import fault_injection

    fault_injection.install_from_env()
