pytest_plugins = ["tests.conftest_dynamodb"]
pytest_plugins += ["tests.conftest_redis"]
pytest_plugins += ["tests.conftest_nodes"]


def pytest_report_header() -> str:
    """Which build the suite runs on: compiled by mypyc, or pure Python (tests/test_build.py)."""
    import meter

    return f"meter build: {meter.BUILD.describe()}"
