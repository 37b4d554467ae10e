"""specd data plane. Packages are the layers, top to bottom; each imports only downward
(import-linter checks it, see pyproject.toml and docs/architecture.md):

    cli -> gateway -> pool -> engine -> scheduler | speculative -> runner -> requests
        -> model -> mem_cache -> specd.kernels -> config, contracts, types, rung (the floor)
"""
