pytest_plugins = ["tests.conftest_dynamodb"]
pytest_plugins += ["tests.conftest_redis"]
pytest_plugins += ["tests.conftest_nodes"]
