"""The libctr ABI version this binding was written for (CTR_ABI_VERSION in ctr/ctr.h).

It lives in a module of its own, with no imports and no side effects, so that it is the one
place to change when the binding follows a new ABI, and so that a test can substitute it
(through sys.modules) before the package loads the library and checks it.
"""

ABI_VERSION = 1
