"""Test order for the two workers, which take whole files (``--dist loadfile``): the heaviest files first, so
that the last files handed out are short and both workers finish together. A file's weight is its count of
``slow`` tests (multi-process jobs, tens of seconds each), then its count of tests."""

from collections import Counter


def pytest_collection_modifyitems(items):
    slow, tests = Counter(), Counter()
    for item in items:
        tests[item.path] += 1
        slow[item.path] += item.get_closest_marker("slow") is not None
    items.sort(key=lambda item: (-slow[item.path], -tests[item.path]))
