pytest_plugins = ["tests.conftest_dynamodb"]
