pytest_plugins = ["tests.support.fixtures_dynamodb"]
pytest_plugins += ["tests.support.fixtures_redis"]
pytest_plugins += ["tests.support.fixtures_nodes"]
pytest_plugins += ["tests.support.fixtures_xdist"]


def pytest_report_header() -> str:
    """Which build the suite runs on: compiled by mypyc, or pure Python (tests/test_build.py)."""
    import meter

    return f"meter build: {meter.BUILD.describe()}"
