"""The test suite as a package: tests and helpers import each other's shared pieces as ``tests.<helper>``.

pytest finds the repository root above this package and puts it (not a test folder) on ``sys.path``; each
test module is then ``tests.<folder>.test_<name>``, so two folders may hold modules of the same name. Helpers
(no ``test_`` prefix) hold what several modules share; a test module is never imported by another
(tests/test_test_imports.py checks it).
"""
