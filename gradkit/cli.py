"""The ``gradkit`` command: ``gradkit audit``, ``gradkit rules``, ``gradkit demo``.

``gradkit audit FILE.py[:FUNC] …`` imports a user file and audits functions in
it (see :func:`gradkit.audit`) at example inputs given on the command line
(``--arg "f32[128]:uniform(-1,1)"``, one per positional parameter) or declared
in the file (``GRADKIT_INPUTS = {"loss": (x, y)}``, or a function returning
such a dict; values may be arrays, numbers, pytrees or the same spec strings),
or built by a function (``--args-from FILE.py:MAKE``: ``MAKE()`` or
``MAKE(key)`` returns the tuple of inputs, pytrees allowed). Exit codes: 0
every gradient finite, 1 a finding remains, 2 bad arguments or inputs (one
line on stderr starting with ``[gradkit]`` per problem, no traceback).
"""

from gradkit._src.cli.inputs import SPEC_HELP as SPEC_HELP
from gradkit._src.cli.inputs import UsageError as UsageError
from gradkit._src.cli.inputs import parse_spec as parse_spec
from gradkit._src.cli.main import build_parser as build_parser
from gradkit._src.cli.main import main as main
from gradkit._src.cli.main import rule_catalog as rule_catalog

__all__ = [
    "SPEC_HELP",
    "UsageError",
    "build_parser",
    "main",
    "parse_spec",
    "rule_catalog",
]

if __name__ == "__main__":
    raise SystemExit(main())
