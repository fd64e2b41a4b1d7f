"""Imported once by the process that `titan train`'s CPU ranks are forked from (`titan_core.rank_fork`): what
every rank imports, with the garbage collector paused. Each rank then freezes what it inherited, as `launch.main`
does in a rank of its own; the server itself does not (its interpreter ends with a teardown, where frozen objects
make triton's bindings report them as leaked). Importing this module anywhere else only costs the imports."""

from titan_core.launch import collector_paused

with collector_paused():
    import torch._dynamo  # noqa: F401  (torch 2.15's init_process_group imports it in every rank)

    import titan_core.trainer  # noqa: F401
