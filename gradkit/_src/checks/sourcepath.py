"""How a user's source file is shown in reports: relative to the working directory, or as a notebook cell.

Jupyter runs each cell as a temporary file (``/tmp/ipykernel_1234/5678.py``); a report that names it tells
the reader nothing and leaks a machine path into saved notebooks. IPython knows which cell each such file
is, and its own tracebacks say ``Cell In[3], line 28``; this says ``cell In[3]``.
"""

from __future__ import annotations

import sys


def notebook_cell(path: str) -> str | None:
    """``cell In[N]`` when ``path`` is the file IPython compiled cell N into, else None.

    IPython is only consulted when the program already imported it (a Jupyter kernel or an IPython shell).
    """
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    if get_ipython is None:
        return None
    shell = get_ipython()
    format_code_name = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if format_code_name is None:  # no shell, or an IPython older than 8
        return None
    name = format_code_name(path)
    return None if name is None else f"cell {name[1]}"
