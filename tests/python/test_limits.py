"""The Python package's limits against common/fps_limits.h, the one place
they are written (the package cannot include a C header, so it repeats
them: this test holds it to them)."""

import inspect
import os
import re
import unittest

import _support  # noqa: F401
from factorps import _lib
from factorps import client

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "common", "fps_limits.h")


def header_value(name):
    text = open(HEADER, encoding="utf-8").read()
    m = re.search(r"^#define %s \(?([^/\n]*?)\)?\s*(/\*.*)?$" % name, text, re.M)
    if not m:
        raise AssertionError("%s not defined in %s" % (name, HEADER))
    expr = m.group(1).replace("u", "")
    if not re.fullmatch(r"[0-9 *()<+-]+", expr):
        raise AssertionError("%s: cannot read %r" % (name, expr))
    return eval(expr)  # digits and arithmetic only (checked above)


class LimitsTest(unittest.TestCase):
    def test_name_and_dims(self):
        self.assertEqual(_lib.NAME_MAX, header_value("FPS_TENSOR_NAME_MAX"))
        self.assertEqual(_lib.MAX_DIMS, header_value("FPS_MAX_DIMS"))

    def test_default_message_size(self):
        default = inspect.signature(client.Client.__init__).parameters["max_message_bytes"].default
        self.assertEqual(default, header_value("FPS_MESSAGE_BYTES_DEFAULT"))


if __name__ == "__main__":
    unittest.main()
