"""The command line and the pieces around it: `cli` (`art demo`, `art runs`, `art report`,
`art trajectories`, `art serve`; the `art` console script runs `art_core.app.cli:main`), `demo`
(the fruit-stand demo), `plotting` (reward plots), reading runs back (`runs`, `report` (HTML),
`svg`, `trajectories_view`) and `processes` (free ports, waiting for a server, stopping a process
group).

Exports the `processes` helpers (`free_port`, `wait_healthy`, `stop_group`, `log_tail`,
`ServerStartError`), which tests, scripts and benchmarks share; they import only the standard
library and httpx. The demo's `SCENARIOS` and `rollout` (reused by examples/fruit_stand.py) are
exported lazily, so importing this package loads no model code.
"""

from typing import TYPE_CHECKING

from art_core._lazy import lazy_exports
from art_core.app.processes import ServerStartError, free_port, log_tail, stop_group, wait_healthy

if TYPE_CHECKING:
    from art_core.app.demo import SCENARIOS as SCENARIOS
    from art_core.app.demo import rollout as rollout

_DEMO, __getattr__ = lazy_exports(__name__, {"art_core.app.demo": ("SCENARIOS", "rollout")})
__all__ = ["ServerStartError", "free_port", "log_tail", "stop_group", "wait_healthy", *_DEMO]
