"""The one import of xgrammar, on first use.

``load_xgrammar()`` returns the module, or raises ImportError naming the pip line. Every structured-output
module asks it when it first needs the library, so importing any of them is free and works without
xgrammar; only building a compiler or a matcher, or applying a mask, needs it.
"""

from __future__ import annotations

XGRAMMAR_PIP = "pip install xgrammar==0.2.8"


def load_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(f"structured output needs the xgrammar package: {XGRAMMAR_PIP}") from e
    return xgrammar
