"""The command line: `cli` (`art demo`, `art runs`, `art serve`; the `art` console script runs
`art_core.app.cli:main`), `demo` (the fruit-stand demo) and `plotting` (reward plots).

Nothing is exported here.
"""
