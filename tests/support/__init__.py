"""The suite's harness, imported by the tests and by ``bench/``; no tests here.

- :mod:`~tests.support.nodes`: real ``meter serve`` processes (``NodeProcess``, ``raw_call``,
  ``wait_for``, ``short_tmpdir``);
- :mod:`~tests.support.cluster_harness`: a clustered node's environment, starting ``n`` of
  them, a persistent RPC connection, load threads, the convergence measurement;
- :mod:`~tests.support.redis_server`, :mod:`~tests.support.dynamodb_local`: throw-away
  ``redis-server`` and Amazon DynamoDB Local processes on free loopback ports;
- :mod:`~tests.support.redis_cluster`: a throw-away Redis Cluster (3 masters, a replica each),
  and a master's kill with its replica's promotion;
- :mod:`~tests.support.dynamodb_proxy`, :mod:`~tests.support.lossy_proxy`: fault-injecting
  proxies in front of DynamoDB Local;
- :mod:`~tests.support.stores`: in-memory stores with faults switched on by hand;
- :mod:`~tests.support.machine_reach`: what a hypothesis state machine's rules reached;
- :mod:`~tests.support.measure_convergence`: the convergence measurement for ``bench/``;
- ``fixtures_*``: the pytest fixtures, loaded as plugins by ``tests/conftest.py``.
"""
