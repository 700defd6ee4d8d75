"""Sandboxes: run commands on files in fresh, isolated, single-use sandboxes; warm pools; fleets.

The public API (`run`, `Sandbox`, `Result`, ...) is defined in `envs.sandbox.api` and re-exported
here:

    from envs import sandbox
    r = sandbox.run(files={"main.py": "print(1)"}, command=["python3", "main.py"])

Modules: `api` (`run`, `Sandbox`), `pool` (`WarmPool`), `slot` (one sandbox: its namespaces and
the zygote), `launcher` (host side of the spawn helper), `hostcheck`, the programs (`spawner`, the
spawn helper, and what runs inside the sandbox: `zygote`, `command_process`, `audit_hook`,
`testrunner`), `testexec` (the host side of the test runner), and the fleets that
run many jobs over warm pools (`fleet`, `fleet_ray`). See envs/README.md.
"""

from envs.sandbox.api import default_pool
from envs.sandbox.api import Result
from envs.sandbox.api import run
from envs.sandbox.api import Sandbox
from envs.sandbox.api import SandboxUnavailable
from envs.sandbox.api import SlotError

__all__ = ["Result", "Sandbox", "SandboxUnavailable", "SlotError", "default_pool", "run"]
