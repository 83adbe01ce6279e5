"""The ctypes structs of factorps._lib against the C header's real layout.

FACTORPS_LAYOUT_DUMP is the layout_dump binary (built from client.h by
tests/python/CMakeLists.txt); it prints every struct's size and the offset
of every field, which must match ctypes' for the same names.
"""

import os
import subprocess
import unittest

import _support  # noqa: F401
from factorps import _lib


class LayoutTest(unittest.TestCase):
    def test_structs_match_header(self):
        exe = os.environ.get("FACTORPS_LAYOUT_DUMP")
        if not exe:
            self.skipTest("FACTORPS_LAYOUT_DUMP not set (run through ctest)")
        out = subprocess.run([exe], check=True, stdout=subprocess.PIPE, text=True,
                             timeout=30).stdout
        seen = {}
        for line in out.splitlines():
            struct, field, value = line.split()
            seen.setdefault(struct, {})[field] = int(value)
        self.assertEqual(set(seen), set(_lib.STRUCTS))
        for struct, fields in seen.items():
            cls = _lib.STRUCTS[struct]
            self.assertEqual(cls and __import__("ctypes").sizeof(cls), fields.pop("-"),
                             f"sizeof({struct})")
            ours = [name for name, _ in cls._fields_]
            self.assertEqual(sorted(fields), sorted(ours), f"{struct}: field names")
            for name, offset in fields.items():
                self.assertEqual(getattr(cls, name).offset, offset, f"{struct}.{name}")


if __name__ == "__main__":
    unittest.main()
