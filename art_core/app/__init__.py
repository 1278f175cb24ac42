"""The command line: `cli` (`art demo`, `art runs`, `art report`, `art trajectories`, `art serve`;
the `art` console script runs `art_core.app.cli:main`), `demo` (the fruit-stand demo), `plotting`
(reward plots), and reading runs back: `runs`, `report` (HTML), `svg`, `trajectories_view`.

Nothing is exported here.
"""
