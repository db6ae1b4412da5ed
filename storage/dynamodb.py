"""The DynamoDB backend (aioboto3): exactly-once delta flushes, in transactions or one
UpdateItem per key (ADR 0015).

Table layout (see ``docs/storage.md``): partition key ``pk`` = tenant, sort key ``sk`` =
``<period>#<feature>``, so every counter of a tenant in a period is one ``Query`` on the prefix
``<period>#``. A month prefix (``2026-11#``) never matches a day item (``2026-11-01#...``)
because ``#`` directly follows the period. Attributes: ``t`` (the total, a Number), ``s_<node>``
(the last applied flush sequence of each node, a Number) and ``ttl`` (epoch seconds: the end of
the period plus ``retention_days``).

Each delta is written as ``ADD t :d SET s_<node> = :seq`` on the condition that ``s_<node>`` is
absent or lower than ``:seq``. A retry of a write that already landed - ours or botocore's own,
after a lost response - fails that condition instead of adding twice, and is answered from the
item (``Applied(..., duplicate=True)``). Callers keep at most one sequence per (node, key) in
flight and retry the same ``(key, seq, delta)`` until it is ``Applied``.

``flush_mode`` ``batched`` sends those same conditional updates in ``TransactWriteItems`` of up
to ``transact_items`` items (a key's counter and day bucket together) and reads the stored
totals back in ``BatchGetItem`` requests of 100 (:mod:`storage.transactions`); ``auto`` does so but
for keys that met a conflicting write lately (hot keys several nodes flush at once), which go
one ``UpdateItem`` each; ``single`` never batches.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import os
import random
import time
import zlib
from collections.abc import Iterator, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any
from urllib.parse import urlsplit

import aioboto3
import aiohttp
from aiobotocore.config import AioConfig
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    HTTPClientError,
    IncompleteReadError,
    ResponseStreamingError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from storage import periods
from storage.base import (
    DAYS_END,
    EMPTY,
    MARK_CLOSED,
    MARK_DRAINED,
    MARK_OPEN,
    MARK_STATES,
    MAX_VALUE_BYTES,
    NODE_RE,
    VALUE_MARK,
    Applied,
    BadCursor,
    BadItems,
    BudgetItem,
    Delta,
    ExportPage,
    ExportRow,
    GaugeReading,
    Key,
    LedgerRow,
    Owner,
    PeriodMark,
    Snapshot,
    Storage,
    StorageError,
    StoragePermanentError,
    StorageUnavailable,
    VersionMoved,
    WriteStats,
    check_children,
    check_day_of,
    check_export_limit,
    check_owner_note,
    check_period,
    check_period_mark,
    check_range,
    check_unique,
    check_value_of,
    check_values_key,
    check_values_limit,
    decode_cursor,
    encode_cursor,
    gauge_key,
    lease_end_ms,
    mark_units_from_text,
    mark_units_to_text,
    next_values_cursor,
    parent_of,
    timeline_position,
    timeline_range,
    values_cursor,
)
from storage.dynamodb_wire import NoCredentials, Wire, WireError
from storage.transactions import HotKeys, Part, Verdict, judge, pack, token

log = logging.getLogger("meter.storage.dynamodb")

#: DynamoDB's key size limits, in UTF-8 bytes.
MAX_PK_BYTES = 2048
MAX_SK_BYTES = 1024
#: Keys per BatchGetItem request (DynamoDB's limit).
BATCH_GET_LIMIT = 100
#: Most segments of an export's parallel Scan (DynamoDB allows 1,000,000). A cursor keeps one
#: position per segment, up to ~1 KB each with the protocol's longest names: 32 keep it well
#: inside the protocol's 64 KiB string limit.
MAX_SEGMENTS = 32
#: Node ids become attribute names (``s_<node>``): kept to :data:`storage.base.NODE_RE`.
SEQ_PREFIX = "s_"

#: Error codes worth retrying: the request did not (or may not) have been applied and the
#: same request can succeed later. Retrying an UpdateItem is safe thanks to its condition.
RETRYABLE_CODES = frozenset(
    {
        "ProvisionedThroughputExceededException",
        "ThrottlingException",
        "Throttling",
        "RequestLimitExceeded",
        "TransactionConflictException",
        "InternalServerError",
        "InternalFailure",
        "ServiceUnavailable",
        "LimitExceededException",
    }
)
#: 4xx errors that a fix outside this request cures (credentials, a missing table): reported as
#: unavailable so the caller keeps its deltas, but not retried in place since waiting won't help.
OPERATOR_CODES = frozenset(
    {
        "ResourceNotFoundException",
        "UnrecognizedClientException",
        "InvalidSignatureException",
        "ExpiredTokenException",
        "AccessDeniedException",
        "MissingAuthenticationTokenException",
        "IncompleteSignatureException",
    }
)
#: Failures of the transport: the request may or may not have reached DynamoDB.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    BotoConnectionError,  # botocore: connection refused, connect timeout, DNS, TLS
    HTTPClientError,  # botocore: connection closed, read timeout
    IncompleteReadError,
    ResponseStreamingError,
    aiohttp.ClientError,
    OSError,
    asyncio.TimeoutError,
)

#: Credentials used against a loopback endpoint (DynamoDB Local) when none are configured.
LOCAL_DUMMY_CREDENTIALS = ("meter-local", "meter-local")
LOCAL_DEFAULT_REGION = "us-east-1"

#: The owner of node id ``n`` (ADR 0004) is the item ``pk = OWNER_PK, sk = "owner#" + n`` with
#: ``tok`` (S) and ``exp`` (N, the lease's end in epoch ms). Tenants never contain ``#``.
OWNER_PK = "#meter"
#: Limits records are the items ``pk = OWNER_PK, sk = "lim#<scope>#<name>#<feature>"`` (names
#: never contain ``#``) with ``sc``, ``n``, ``f`` (absent when empty), ``b`` (S); their
#: version is the item ``sk = "limits-version"`` with ``v`` (N).
_LIMIT_SK = "lim#"
_LIMITS_VERSION_KEY: dict[str, Any] = {"pk": {"S": OWNER_PK}, "sk": {"S": "limits-version"}}
#: The budget of a counter under a strict limit (ADR 0009) is the item ``pk = tenant,
#: sk = "#b#<period>#<feature>"`` (never a counter's ``<period>#...``, so queries and exports of
#: counters skip it) with ``v`` (N, its version), ``b`` (S, the record) and ``ttl``.
_BUDGET_SK = "#b#"
#: A claimed threshold alert (docs/quotas.md) is the item ``pk = OWNER_PK, sk = "alert#" + id``
#: with ``b`` (S): the body of the claim that stored it first.
_ALERT_SK = "alert#"
#: A cluster setting (ADR 0024) is the item ``pk = OWNER_PK, sk = "setting#" + name`` with ``b``
#: (S): the value stored first. No ``ttl``: kept for good.
_SETTING_SK = "setting#"
#: A tenant's credits ledger (docs/ledger.md) lives in the tenant's partition under sort keys
#: that start with ``#l#`` (never a counter's ``<period>#...`` nor a budget's ``#b#``): the
#: balance record ``#l#bal`` with ``v`` (N, its version) and ``b`` (S); each entry
#: ``#l#e#<seq, 20 digits>`` with ``b`` (S), so a Query on the prefix reads them in order;
#: each ref record ``#l#r#<ref>`` with ``b`` (S). No ``ttl``: a ledger is kept for good.
#: Every tenant's ledger entries in time order (docs/ledger.md, "Timeline"): each entry is also
#: the item ``pk = "#tl#<k>", sk = <timeline position>`` with ``t`` (S, tenant), ``s`` (N, seq)
#: and ``b`` (S), written in the entry's transaction; ``k``, the tenant's CRC-32 modulo
#: :data:`TIMELINE_PARTITIONS`, scatters a busy time over partitions (a time-ordered key in one
#: partition would put every write of the moment on one). A page queries each partition's
#: range and merges them. No tenant holds ``#``: no tenant's query meets them.
_TIMELINE_PK = "#tl#"
TIMELINE_PARTITIONS = 16
_LEDGER_BALANCE_SK = "#l#bal"
_LEDGER_ENTRY_SK = "#l#e#"
_LEDGER_REF_SK = "#l#r#"
#: The day bucket of a month counter (docs/history.md) is the item ``pk = tenant,
#: sk = "#d#<feature>#<YYYY-MM-DD>"`` with ``t``, ``s_<node>`` and ``ttl`` like a counter's: one
#: tenant and feature's days are one sort-key range (one Query), and no counter's
#: ``<period>#...`` prefix (queries, exports) nor any key ``load`` asks for ever matches it.
_DAY_SK = "#d#"
#: A unique feature's value (docs/storage.md, "Unique values") is the item ``pk = tenant,
#: sk = "#u#<period>#<feature>\x1f<value>"`` with ``c`` (S, the claimant that stored it first)
#: and ``ttl`` as its counter's: one key's values are one sort-key range in value order (a
#: page is one Query), and no counter's ``<period>#...`` prefix, day bucket's ``#d#`` range
#: nor key ``load`` asks for ever matches it (no counter's sort key starts with ``#``).
_VALUE_SK = "#u#"
#: A node's mark of a counting period (docs/storage.md, "Period marks") is the item
#: ``pk = "#periods#<period>", sk = <node>`` with ``state`` (S), ``at`` (N), ``by`` (S) and
#: ``ttl`` as the period's counters': no tenant holds ``#`` (no tenant's
#: query or read meets it) and no node id does (:data:`NODE_RE`), so the export scan's
#: ``begins_with(sk, "<period>#")`` never matches it.
_MARKS_PK = "#periods#"
#: How many times a period mark's conditional put is tried while the stored mark read after a
#: refusal (no ``ALL_OLD``: DynamoDB Local) is one it replaces (changed in between).
_MARK_TRIES = 3
#: Above every character of a feature name (``[A-Za-z0-9_.:-]``): ``<period>#~`` ends a
#: period's sort-key range.
_SK_END = "~"
_CLAIM_CONDITION = "attribute_not_exists(#tok) OR #exp <= :now OR #tok IN ({})"

# The TTL is set on every write: it only grows (later of period end and now), so a counter
# still being written is never expired.
_UPDATE_EXPRESSION = "ADD #t :d SET #s = :seq, #ttl = :ttl"
#: A counter of a tenant below an account (``acme/alice``), with ``children`` on, also sets
#: ``cp`` (S, ``<parent>#<feature>``) and ``cs`` (S, ``<period>#<tenant>``), the keys of the
#: sparse global secondary index :data:`CHILDREN_INDEX` (projecting ``t``): an account's
#: users of one counter in one period are one ``Query`` (``cp = :cp AND cs BETWEEN``). No
#: tenant holds ``#``, so ``<parent>#`` ends the parent; a period holds none either, and
#: ``<period>$`` (``$`` follows ``#``) ends the period's range, before any longer period name.
_CHILD_UPDATE_EXPRESSION = _UPDATE_EXPRESSION + ", cp = :cp, cs = :cs"
CHILDREN_INDEX = "children"
_CONDITION = "attribute_not_exists(#s) OR #s < :seq"


class _ConditionFailed(Exception):
    """Internal: an UpdateItem's condition failed (the sequence was applied before)."""

    def __init__(self, item: dict[str, Any] | None) -> None:
        super().__init__("conditional check failed")
        self.item = item


class DynamoDBStorage(Storage):
    """Counters in one DynamoDB table, written with conditional ``UpdateItem`` calls.

    ``max_attempts`` is botocore's own attempt count per call (standard retry mode);
    ``retries`` is how many more times this class tries a call that failed transiently,
    with exponential backoff and full jitter between ``backoff_base`` and ``backoff_cap``
    seconds. ``concurrency`` bounds the requests in flight across all calls but the batch
    reads, which have ``load_concurrency`` permits of their own (not queued behind a flush
    round's writes) and connections of their own: the pool holds
    ``max(max_pool_connections, concurrency) + load_concurrency`` connections, so writes can
    never take the reads' connections. Every ``load`` shares the read permits, also a bulk one
    of thousands of keys (the flusher seeding unseeded keys, a re-read after a claim): while
    it runs, a cold key's seeding read may wait for a permit. When ``endpoint_url`` is a
    loopback address and no credentials are configured, dummy static credentials are used so
    DynamoDB Local works without any AWS setup.
    """

    kind = "dynamodb"

    def __init__(
        self,
        table: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        max_pool_connections: int = 64,
        connect_timeout: float = 2,
        read_timeout: float = 5,
        concurrency: int = 64,
        retention_days: int = 400,
        max_attempts: int = 2,
        retries: int = 2,
        backoff_base: float = 0.05,
        backoff_cap: float = 1.0,
        export_segments: int = 8,
        flush_mode: str = "auto",
        transact_items: int | None = None,
        children: bool = False,
    ) -> None:
        if flush_mode not in FLUSH_MODES:
            raise ValueError(f"flush_mode must be one of {', '.join(FLUSH_MODES)}")
        if transact_items is not None and not 2 <= transact_items <= TRANSACT_LIMIT:
            raise ValueError(f"transact_items must be in 2..{TRANSACT_LIMIT}")
        if not table:
            raise ValueError("table must not be empty")
        if concurrency < 1 or max_pool_connections < 1 or max_attempts < 1:
            raise ValueError("concurrency, max_pool_connections and max_attempts must be >= 1")
        if not 1 <= export_segments <= MAX_SEGMENTS:
            raise ValueError(f"export_segments must be in 1..{MAX_SEGMENTS}")
        if retries < 0 or retention_days < 0:
            raise ValueError("retries and retention_days must not be negative")
        self.table = table
        #: Whether counters of tenants below an account are written to the ``children``
        #: index (``tenant_hierarchy`` on; :data:`_CHILD_UPDATE_EXPRESSION`).
        self.children = children
        #: Segments of an export's parallel Scan.
        self.export_segments = export_segments
        self.endpoint_url = endpoint_url
        self.region = region
        self.retention_days = retention_days
        self.retries = retries
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        # Seeding: one BatchGetItem of 100 keys per load, 8 at once (a bare loop reads the
        # most keys/s near there; more only queues in the service).
        self.load_chunk = BATCH_GET_LIMIT
        self.load_concurrency = min(8, concurrency)
        #: Connections in the client's pool: reads have ``load_concurrency`` of their own
        #: beside the writes' (see _read_sem), whose count ``concurrency`` may exceed the
        #: configured pool.
        self.pool_connections = max(max_pool_connections, concurrency) + self.load_concurrency
        self._config = AioConfig(
            max_pool_connections=self.pool_connections,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"max_attempts": max_attempts, "mode": "standard"},
            # Every request is built here from checked keys: botocore's own validation of
            # each one took a fifth of a node's CPU while it seeded cold keys. DynamoDB still
            # refuses a bad request (ValidationException: a permanent error, as before).
            parameter_validation=False,
        )
        self._timeouts = (connect_timeout, read_timeout)
        #: Tries of one request on the wire (botocore's attempts, then ours).
        self._wire_attempts = max_attempts + retries
        self._wire: Wire | None = None
        self._sem = asyncio.Semaphore(concurrency)
        # Batch reads (seeding) do not queue behind a flush round's writes in _sem: a cold
        # key's caller waited up to seconds behind a round of thousands of UpdateItems.
        self._read_sem = asyncio.Semaphore(self.load_concurrency)
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Any = None
        #: Requests issued, by operation name (each of our attempts counts once).
        self.calls: collections.Counter[str] = collections.Counter()
        #: Deltas refused as already applied (answered from the item).
        self.duplicates = 0
        #: Day-bucket writes refused as already applied.
        self.day_duplicates = 0
        #: Items per Query page (None: DynamoDB's own 1 MB pages); small values test paging.
        self.page_size: int | None = None
        #: How deltas are written (module doc): ``single``, ``batched`` or ``auto``.
        self.flush_mode = flush_mode
        #: Items per transaction: DynamoDB takes 100, DynamoDB Local 10 (the default on a
        #: loopback endpoint).
        local = endpoint_url is not None and _is_loopback(endpoint_url)
        self.transact_items = transact_items or (LOCAL_TRANSACT_LIMIT if local else TRANSACT_LIMIT)
        #: Entries one ledger write may hold: two items each (the entry and its timeline
        #: item) beside the balance and a ref, in what this endpoint's transactions take (a
        #: ledger needs 3 at least: 8 items).
        self.ledger_max_entries = max(3, (self.transact_items - 2) // 2)
        #: ``auto``: keys that met a conflicting write, and until when (monotonic) they are
        #: written alone.
        self._hot = HotKeys(HOT_S)
        #: This process, in transactions' tokens (transactions.token).
        self._run = os.urandom(8).hex()
        #: Counter and day-bucket updates that landed, and the write units they cost as
        #: DynamoDB bills them for items up to 1 KB: 1 an ``UpdateItem``, 2 an item of a
        #: transaction (also of a cancelled one).
        self.items_written = 0
        self.write_units = 0
        #: Transactions sent, and of those cancelled.
        self.transactions = 0
        self.cancelled = 0
        #: Keys answered with what the caller knew plus their delta, not read back.
        self.derived = 0
        #: Flush ``UpdateItem`` calls sent (a key's item alone).
        self.flush_updates = 0

    @property
    def writes(self) -> int:
        """Write requests issued so far, ``UpdateItem`` calls and transactions (for
        benchmarks: writes per flush)."""
        return self.calls["update_item"] + self.calls["transact_write_items"]

    def write_stats(self) -> WriteStats:
        return WriteStats(
            self.flush_mode,
            self.flush_updates + self.transactions,
            self.items_written,
            self.write_units,
            self.transactions,
            self.cancelled,
            len(self._hot),
            self.derived,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Create the session and enter the client; it lives until :meth:`close`."""
        if self._client is not None:
            return
        session = await self._session()
        stack = contextlib.AsyncExitStack()
        try:
            client = await stack.enter_async_context(
                session.client("dynamodb", endpoint_url=self.endpoint_url, config=self._config)
            )
            # The flush's transactions and read-backs: signed JSON of their own (ADR 0015), to
            # the endpoint botocore resolved, with the session's credentials.
            credentials = await session.get_credentials()
            wire = Wire(
                client.meta.endpoint_url,
                client.meta.region_name,
                credentials,
                connections=self.pool_connections,
                connect_timeout=self._timeouts[0],
                read_timeout=self._timeouts[1],
                user_agent=f"meter-flush aiohttp/{aiohttp.__version__}",
            )
            await wire.open()
            stack.push_async_callback(wire.close)
        except BotoCoreError as exc:  # an invalid endpoint URL, a bad credentials setup
            await stack.aclose()
            raise StoragePermanentError(f"dynamodb: cannot create a client: {exc}") from exc
        except BaseException:
            await stack.aclose()
            raise
        # Only once everything is open: a failure above leaves nothing half open behind.
        self._client, self._wire, self._stack = client, wire, stack

    async def close(self) -> None:
        """Exit the client's context (closes its connection pool)."""
        stack, self._stack, self._client, self._wire = self._stack, None, None, None
        if stack is not None:
            await stack.aclose()

    async def _session(self) -> aioboto3.Session:
        session = aioboto3.Session(region_name=self.region)
        local = self.endpoint_url is not None and _is_loopback(self.endpoint_url)
        if local:
            # Instance/container roles make no sense for a local endpoint, and probing for them
            # would reach the metadata service (a network round trip off this host).
            resolver = session._session.get_component("credential_provider")
            for name in ("container-role", "iam-role"):
                with contextlib.suppress(Exception):
                    resolver.remove(name)
        try:
            credentials = await session.get_credentials()
        except BotoCoreError as exc:
            raise StoragePermanentError(f"dynamodb: bad AWS credentials setup: {exc}") from exc
        region = session.region_name or (LOCAL_DEFAULT_REGION if self.endpoint_url else None)
        if region is None:
            raise StoragePermanentError(
                "dynamodb: no AWS region configured (set AWS_REGION or AWS_DEFAULT_REGION)"
            )
        if credentials is None and local:
            key, secret = LOCAL_DUMMY_CREDENTIALS
            return aioboto3.Session(
                aws_access_key_id=key, aws_secret_access_key=secret, region_name=region
            )
        session._session.set_config_variable("region", region)
        return session

    # -- schema ------------------------------------------------------------------------------

    async def init_schema(self) -> str:
        """Create the table (on-demand) if missing, wait until ACTIVE, enable TTL on ``ttl``."""
        created = False
        try:
            desc = await self._call("describe_table", "describe table", TableName=self.table)
        except StorageUnavailable as exc:
            if not isinstance(exc.__cause__, ClientError) or _code(exc.__cause__) != (
                "ResourceNotFoundException"
            ):
                raise
            desc = await self._create_table()
            created = True
        status = desc["Table"]["TableStatus"]
        for _ in range(300):  # a fresh table is ACTIVE within seconds; bound the wait anyway
            if status == "ACTIVE":
                break
            await asyncio.sleep(0.2)
            desc = await self._call("describe_table", "describe table", TableName=self.table)
            status = desc["Table"]["TableStatus"]
        else:
            raise StorageUnavailable(f"dynamodb: table {self.table} is still {status}")
        index = await self._add_children_index() if self.children else ""
        if self.children and not created:
            index += f", {await self._backfill_children()} users' counters written to it"
        ttl = await self._enable_ttl()
        verb = "created" if created else "exists"
        return f"dynamodb: table {self.table} {verb} (ACTIVE); {index and index + '; '}{ttl}"

    async def _add_children_index(self) -> str:
        """Add the ``children`` index to a table made by a build without it. Not waited for:
        DynamoDB fills a new index from the items already holding ``cp`` (minutes on a large
        table), and ``usage_children`` is ``unavailable`` until it has; the report says
        which state it is in."""
        desc = await self._call("describe_table", "describe table", TableName=self.table)
        status = _index_status(desc)
        if status is not None:
            return f"index {CHILDREN_INDEX} exists ({status})"
        create = dict(_CHILDREN_GSI)
        throughput = desc["Table"].get("ProvisionedThroughput") or {}
        if throughput.get("ReadCapacityUnits"):  # (a table of provisioned capacity: its own)
            create["ProvisionedThroughput"] = {
                "ReadCapacityUnits": throughput["ReadCapacityUnits"],
                "WriteCapacityUnits": throughput["WriteCapacityUnits"],
            }
        try:
            await self._call(
                "update_table",
                "add the children index",
                TableName=self.table,
                AttributeDefinitions=_CHILDREN_ATTRIBUTES,
                GlobalSecondaryIndexUpdates=[{"Create": create}],
            )
        except StoragePermanentError:
            # Another process may have added it between our describe and update.
            desc = await self._call("describe_table", "describe table", TableName=self.table)
            if _index_status(desc) is None:
                raise
        return (
            f"index {CHILDREN_INDEX} added (DynamoDB fills it from the items written so far; "
            "usage_children answers once it is ACTIVE: run storage init again to see)"
        )

    async def _backfill_children(self) -> int:
        """Give every counter of a user (a tenant with ``/``) that lacks them its index keys
        (written by an earlier build, or with the hierarchy off): one ``Scan`` of the table,
        an ``UpdateItem`` each (32 at once); how many. Logged every 10,000."""
        scan: dict[str, Any] = {
            "TableName": self.table,
            "ProjectionExpression": "pk, sk",
            "FilterExpression": (
                "contains(pk, :slash) AND attribute_not_exists(cp) AND NOT begins_with(sk, :h)"
            ),
            "ExpressionAttributeValues": {":slash": {"S": "/"}, ":h": {"S": "#"}},
        }
        done = 0

        async def one(tenant: str, sk: str) -> None:
            period, _, feature = sk.partition("#")
            parent = parent_of(tenant)
            if parent is None or tenant.startswith("#") or not feature:
                return
            await self._call(
                "update_item",
                "index a user's counter",
                TableName=self.table,
                Key={"pk": {"S": tenant}, "sk": {"S": sk}},
                UpdateExpression="SET cp = :cp, cs = :cs",
                ConditionExpression="attribute_exists(pk)",
                ExpressionAttributeValues={
                    ":cp": {"S": f"{parent}#{feature}"},
                    ":cs": {"S": f"{period}#{tenant}"},
                },
            )

        while True:
            resp = await self._call("scan", "find users' counters to index", **scan)
            items = [(i["pk"]["S"], i["sk"]["S"]) for i in resp.get("Items", [])]
            for at in range(0, len(items), 32):
                await asyncio.gather(*(one(t, sk) for t, sk in items[at : at + 32]))
            if done // 10_000 != (done + len(items)) // 10_000:
                log.info("dynamodb: %d users' counters indexed so far", done + len(items))
            done += len(items)
            last = resp.get("LastEvaluatedKey")
            if not last:
                return done
            scan["ExclusiveStartKey"] = last

    async def _create_table(self) -> dict[str, Any]:
        try:
            resp = await self._call(
                "create_table",
                "create table",
                TableName=self.table,
                BillingMode="PAY_PER_REQUEST",
                KeySchema=TABLE_KEYS,
                AttributeDefinitions=[*TABLE_ATTRIBUTES, *_CHILDREN_ATTRIBUTES],
                GlobalSecondaryIndexes=[_CHILDREN_GSI],
            )
        except StoragePermanentError as exc:
            # Another process created it between our describe and create: that is fine.
            if isinstance(exc.__cause__, ClientError) and _code(exc.__cause__) == (
                "ResourceInUseException"
            ):
                return {"Table": {"TableStatus": "CREATING"}}
            raise
        return {"Table": {"TableStatus": resp["TableDescription"]["TableStatus"]}}

    async def _enable_ttl(self) -> str:
        try:
            desc = await self._call("describe_time_to_live", "describe TTL", TableName=self.table)
        except StoragePermanentError as exc:
            return f"TTL not supported by this endpoint ({exc})"
        ttl = desc.get("TimeToLiveDescription", {})
        status, attr = ttl.get("TimeToLiveStatus"), ttl.get("AttributeName")
        if status in ("ENABLED", "ENABLING"):
            if attr == "ttl":
                return "TTL on 'ttl' already enabled"
            return f"TTL is on {attr!r}, not 'ttl': left as it is (change it by hand)"
        try:
            await self._call(
                "update_time_to_live",
                "enable TTL",
                TableName=self.table,
                TimeToLiveSpecification={"Enabled": True, "AttributeName": "ttl"},
            )
        except StoragePermanentError as exc:
            # DynamoDB Local answers a repeated enable with a ValidationException.
            if "already enabled" in str(exc):
                return "TTL on 'ttl' already enabled"
            raise
        return "TTL on 'ttl' enabled"

    # -- reads and writes --------------------------------------------------------------------

    async def apply(self, node: str, deltas: Sequence[Delta]) -> dict[Key, Applied | StorageError]:
        if not deltas:
            return {}
        if NODE_RE.fullmatch(node) is None:
            bad = StoragePermanentError(f"dynamodb: node id {node[:64]!r} is not allowed")
            return {d.key: bad for d in deltas}
        attr = SEQ_PREFIX + node
        alone: list[Delta] = list(deltas)
        batched: list[Delta] = []
        if self.flush_mode != "single":
            hot = self._hot.hot(time.monotonic()) if self._hot else frozenset()
            alone = [d for d in deltas if d.key in hot]
            batched = [d for d in deltas if d.key not in hot] if alone else list(deltas)
        singles, out = await asyncio.gather(
            asyncio.gather(*(self._apply_one(attr, d) for d in alone)),
            self._apply_batched(node, attr, batched),
        )
        for d, r in zip(alone, singles, strict=True):
            out[d.key] = r
        return out

    async def _apply_batched(
        self, node: str, attr: str, deltas: Sequence[Delta]
    ) -> dict[Key, Applied | StorageError]:
        """The deltas' updates in transactions (:mod:`storage.transactions`), sent by a few
        workers, again for what a cancellation says can go again; each hundred keys landed
        read back at once while the rest are written. A key whose fate a transaction cannot
        tell is written alone (:meth:`_apply_one`). The loop is handed back every few hundred
        keys of work, so a large round never holds it for long."""
        out: dict[Key, Applied | StorageError] = {}
        if not deltas:
            return out
        by_key = {d.key: d for d in deltas}
        pending: dict[Key, list[Part]] = {}
        ttls: dict[str, dict[str, Any]] = {}
        for i, d in enumerate(deltas):
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
            try:
                pending[d.key] = self._parts(attr, d, ttls)
            except StorageError as exc:
                out[d.key] = exc
        duplicates: set[Key] = set()
        alone: set[Key] = set()
        ready: list[Key] = []
        derived: dict[Key, Snapshot] = {}
        reads: list[asyncio.Future[dict[Key, Snapshot | StorageError]]] = []
        last = "dynamodb: transactions kept being cancelled"

        def landed(key: Key) -> None:
            pending.pop(key, None)
            d = by_key[key]
            known = d.known
            if (
                key not in duplicates
                and known is not None
                and known.seq_of(node) == d.seq - 1
                and all(n == node for n in known.seqs)
            ):
                # Every update of the key passed its condition: the item held no sequence of
                # ours from d.seq on; known holds all below it and no other node's: so known
                # plus this delta is the item as this write left it, unless another node
                # wrote it since (its units are then in the caller's view as its gossip, and
                # the next read takes them in; ADR 0015). No read needed.
                derived[key] = Snapshot(known.total + d.delta, {node: d.seq})
                return
            ready.append(key)
            if len(ready) >= BATCH_GET_LIMIT:
                reads.append(asyncio.ensure_future(self._read_back(ready[:])))
                ready.clear()

        def settle(group: list[Part], verdict: Verdict | StorageError | _Alone | None) -> bool:
            """Book one transaction's answer; whether it met a busy table."""
            nonlocal last
            keys = list(dict.fromkeys(p.key for p in group))
            if verdict is None:  # written
                self.items_written += len(group)
                for key in keys:
                    landed(key)
                return False
            if isinstance(verdict, StorageError):  # fate unknown: the caller retries
                for key in keys:
                    del pending[key]
                    out[key] = verdict
                return False
            if isinstance(verdict, _Alone):
                for key in keys:
                    del pending[key]
                    alone.add(key)
                return False
            last = f"dynamodb: a flush transaction was cancelled ({verdict.reasons})"
            for part, code in verdict.bad:
                if part.key in pending:
                    del pending[part.key]
                    out[part.key] = StoragePermanentError(
                        f"dynamodb: {_describe(part.key)}"
                        f"{'' if part.day is None else ' day bucket ' + part.day}: "
                        f"{code} in a transaction"
                    )
            for part in verdict.landed:
                if part.day is None:
                    duplicates.add(part.key)
                    self.duplicates += 1
                else:
                    self.day_duplicates += 1
                parts = pending.get(part.key)
                if parts is not None:
                    parts.remove(part)
                    if not parts:
                        landed(part.key)
            if self.flush_mode == "auto" and verdict.conflicted:
                self._hot.conflicted(verdict.conflicted, time.monotonic())
                for key in verdict.conflicted:
                    if key in pending:
                        del pending[key]
                        alone.add(key)
            return verdict.busy

        try:
            for attempt in range(BATCH_ATTEMPTS):
                if not pending:
                    break
                todo = iter(pack(list(pending.values()), self.transact_items))
                busy: list[bool] = []

                async def worker(todo: Iterator[list[Part]], busy: list[bool]) -> None:
                    for group in todo:
                        busy.append(settle(group, await self._transact(node, group)))

                async with asyncio.TaskGroup() as workers:  # (none outlives a failed one)
                    for _ in range(TRANSACT_WORKERS):
                        workers.create_task(worker(todo, busy))
                if any(busy) and pending:
                    await asyncio.sleep(self._backoff(attempt))
            for key in pending:
                out[key] = StorageUnavailable(last)
            if ready:
                reads.append(asyncio.ensure_future(self._read_back(ready)))
            ones = [by_key[k] for k in alone]
            singles = await asyncio.gather(*(self._apply_one(attr, d) for d in ones))
            for d, r in zip(ones, singles, strict=True):
                out[d.key] = r
            for key, known in derived.items():
                out[key] = Applied(known)
            self.derived += len(derived)
            for got in await asyncio.gather(*reads):
                for key, snap in got.items():
                    if isinstance(snap, StorageError):
                        out[key] = snap
                    else:
                        out[key] = Applied(snap, key in duplicates)
        finally:
            for read in reads:  # (cancelled midway: no read left running unowned)
                read.cancel()
        return out

    def _parts(self, attr: str, d: Delta, ttls: dict[str, dict[str, Any]]) -> list[Part]:
        """The conditional updates of ``d``: its counter's, and its day bucket's. ``ttls``:
        each period's ``:ttl`` value, computed once a batch."""
        pk, sk = _item_key(d.key)
        ttl = ttls.get(d.key[2])
        if ttl is None:
            ttl = ttls[d.key[2]] = {"N": str(_ttl(d.key[2], self.retention_days))}
        values = {":d": {"N": str(d.delta)}, ":seq": {"N": str(d.seq)}, ":ttl": ttl}
        names = {"#t": "t", "#s": attr, "#ttl": "ttl"}

        def update(sort_key: str) -> dict[str, Any]:
            return {
                "TableName": self.table,
                "Key": {"pk": {"S": pk}, "sk": {"S": sort_key}},
                "UpdateExpression": _UPDATE_EXPRESSION,
                "ConditionExpression": _CONDITION,
                "ExpressionAttributeNames": names,
                "ExpressionAttributeValues": values,
            }

        counter = update(sk)
        self._index_child(d.key, counter)
        parts = [Part(d.key, d.seq, d.delta, None, counter)]
        if d.day is not None:
            if len(d.day) != 10 or not d.day.startswith(d.key[2] + "-"):
                check_day_of(d.day, d.key[2])  # (a billing cycle's, or raises)
            else:
                check_period(d.day)
            parts.append(Part(d.key, d.seq, d.delta, d.day, update(f"{_DAY_SK}{d.key[1]}#{d.day}")))
        return parts

    def _index_child(self, key: Key, update: dict[str, Any]) -> None:
        """Make a counter's ``update`` also set its ``children`` index keys, when the index
        is kept and its tenant is below an account (values shared: a copy is made)."""
        parent = parent_of(key[0]) if self.children else None
        if parent is None:
            return
        tenant, feature, period = key
        update["UpdateExpression"] = _CHILD_UPDATE_EXPRESSION
        update["ExpressionAttributeValues"] = {
            **update["ExpressionAttributeValues"],
            ":cp": {"S": f"{parent}#{feature}"},
            ":cs": {"S": f"{period}#{tenant}"},
        }

    async def _transact(
        self, node: str, group: list[Part]
    ) -> Verdict | StorageError | _Alone | None:
        """One transaction of ``group``: ``None`` written; a :class:`Verdict` of its
        cancellation; ``_ALONE`` when it cannot say which item failed (each key is then
        written alone); a :class:`StorageError` when its fate is unknown."""
        self.transactions += 1
        self.write_units += 2 * len(group)
        params = {
            "TransactItems": [{"Update": p.update} for p in group],
            "ClientRequestToken": token(self._run, node, self.transactions, group),
        }
        try:
            await self._wire_call(
                "TransactWriteItems", f"a flush transaction of {len(group)} items", params
            )
        except _Cancelled as exc:
            self.cancelled += 1
            verdict = judge(group, exc.reasons)
            if verdict is not None:
                return verdict
            log.warning("dynamodb: %s; writing its keys one by one", exc)
            return _ALONE
        except StoragePermanentError as exc:
            # A refused request (a token sent again with other items, a transaction too
            # large for this endpoint): nothing was written; each key alone tells its own.
            log.warning("dynamodb: %s; writing its keys one by one", exc)
            return _ALONE
        except StorageError as exc:
            return exc
        except Exception as exc:  # a bug must fail these keys, not escape apply()
            log.exception("dynamodb: unexpected error in a flush transaction")
            # Sent or not, nobody knows: the keys go again next round (their conditions
            # answer a delta that landed), never parked.
            return StorageUnavailable(f"dynamodb: a flush transaction: unexpected {exc!r}")
        return None

    async def _read_back(self, keys: list[Key]) -> dict[Key, Snapshot | StorageError]:
        """The stored items of ``keys`` (just written), in consistent ``BatchGetItem``
        requests of 100 (transactions answer no values)."""
        out: dict[Key, Snapshot | StorageError] = {}

        async def chunk(part: list[Key]) -> None:
            wanted = {_item_key(k): k for k in part}
            try:
                items = await self._batch_get(list(wanted), flush=True)
            except StorageError as exc:
                # The deltas are stored: sent again, they are duplicates, answered by a read.
                # So a failed read-back is never a reason to park a key.
                again = StorageUnavailable(f"reading back a flush: {exc}")
                for key in part:
                    out[key] = again
                return
            for key in part:  # (gone again already, expired or restored: sent again)
                out[key] = StorageUnavailable(f"dynamodb: {_describe(key)} is gone after its write")
            for item in items:
                try:
                    key = wanted[(item["pk"]["S"], item["sk"]["S"])]
                except (KeyError, TypeError):
                    continue
                try:
                    out[key] = _snapshot(item)
                except (StorageError, KeyError, TypeError, ValueError, AttributeError) as exc:
                    out[key] = StoragePermanentError(
                        f"dynamodb: undecodable item {_describe(key)}: {exc!r}"[:300]
                    )

        await asyncio.gather(
            *(chunk(keys[i : i + BATCH_GET_LIMIT]) for i in range(0, len(keys), BATCH_GET_LIMIT))
        )
        return out

    async def _apply_one(self, attr: str, d: Delta) -> Applied | StorageError:
        """The counter's write, then (``d.day``) its day bucket's: the bucket is written only
        once the counter holds the delta, each under its own ``s_<node> < seq`` condition.
        Not atomic together: when the second fails (or its answer is lost) the key's outcome
        is that error, and the caller's retry of the same delta is a duplicate on the
        counter and lands (or is a duplicate) on the bucket."""
        if d.day is not None:
            try:
                check_day_of(d.day, d.key[2])
            except StorageError as exc:
                return exc
        applied = await self._apply_item(attr, d)
        if d.day is None or not isinstance(applied, Applied):
            return applied
        day = await self._apply_day(attr, d, d.day)
        return applied if day is None else day

    async def apply_days(self, node: str, deltas: Sequence[Delta]) -> list[StorageError | None]:
        """The bucket's ``UpdateItem`` of each delta, concurrently."""
        if NODE_RE.fullmatch(node) is None:
            bad = StoragePermanentError(f"dynamodb: node id {node[:64]!r} is not allowed")
            return [bad for _ in deltas]
        attr = SEQ_PREFIX + node

        async def one(d: Delta) -> StorageError | None:
            try:
                check_day_of(d.day or "", d.key[2])
                _item_key(d.key)
            except StorageError as exc:
                return exc
            assert d.day is not None
            return await self._apply_day(attr, d, d.day)

        return list(await asyncio.gather(*(one(d) for d in deltas)))

    async def _apply_day(self, attr: str, d: Delta, day: str) -> StorageError | None:
        tenant, feature, period = d.key
        try:
            self.write_units += 1
            self.flush_updates += 1
            await self._call(
                "update_item",
                f"day bucket {day} of {_describe(d.key)}",
                TableName=self.table,
                Key={"pk": {"S": tenant}, "sk": {"S": f"{_DAY_SK}{feature}#{day}"}},
                UpdateExpression=_UPDATE_EXPRESSION,
                ConditionExpression=_CONDITION,
                ExpressionAttributeNames={"#t": "t", "#s": attr, "#ttl": "ttl"},
                ExpressionAttributeValues={
                    ":d": {"N": str(d.delta)},
                    ":seq": {"N": str(d.seq)},
                    ":ttl": {"N": str(_ttl(period, self.retention_days))},
                },
                ReturnValues="NONE",
            )
            self.items_written += 1
        except _ConditionFailed:
            self.day_duplicates += 1  # landed before: a retry whose answer was lost
        except StorageError as exc:
            return exc
        except Exception as exc:  # a bug must fail this key, not escape apply()
            log.exception("dynamodb: unexpected error writing a day bucket")
            return StoragePermanentError(f"dynamodb: day bucket {day}: unexpected {exc!r}")
        return None

    async def _apply_item(self, attr: str, d: Delta) -> Applied | StorageError:
        try:
            pk, sk = _item_key(d.key)
            ttl = _ttl(d.key[2], self.retention_days)
            self.write_units += 1
            self.flush_updates += 1
            update: dict[str, Any] = {
                "TableName": self.table,
                "Key": {"pk": {"S": pk}, "sk": {"S": sk}},
                "UpdateExpression": _UPDATE_EXPRESSION,
                "ConditionExpression": _CONDITION,
                "ExpressionAttributeNames": {"#t": "t", "#s": attr, "#ttl": "ttl"},
                "ExpressionAttributeValues": {
                    ":d": {"N": str(d.delta)},
                    ":seq": {"N": str(d.seq)},
                    ":ttl": {"N": str(ttl)},
                },
                "ReturnValues": "ALL_NEW",
                "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
            }
            self._index_child(d.key, update)
            resp = await self._call("update_item", _describe(d.key), **update)
            self.items_written += 1
            return Applied(_snapshot(resp["Attributes"]))
        except _ConditionFailed as failed:
            # Sequences of one node for one key only grow, so a failed condition - even on our
            # first attempt - means this (node, key, seq) landed before: a retry whose first
            # try's answer was lost. Answer with the item, which contains the delta.
            self.duplicates += 1
            if failed.item is not None and attr in failed.item:
                return Applied(_snapshot(failed.item), duplicate=True)
            try:
                return Applied(await self._get(d.key), duplicate=True)
            except StorageError as exc:
                return exc  # the caller retries; the condition fails again; we read again
        except StorageError as exc:
            return exc
        except Exception as exc:  # a bug must fail this key, not escape apply() (the contract)
            log.exception("dynamodb: unexpected error writing %s", _describe(d.key))
            return StoragePermanentError(f"dynamodb: {_describe(d.key)}: unexpected {exc!r}")

    async def _get(self, key: Key) -> Snapshot:
        pk, sk = _item_key(key)
        resp = await self._call(
            "get_item",
            _describe(key),
            TableName=self.table,
            Key={"pk": {"S": pk}, "sk": {"S": sk}},
            ConsistentRead=True,
        )
        item = resp.get("Item")
        return EMPTY if item is None else _snapshot(item)

    async def load(self, keys: Sequence[Key]) -> dict[Key, Snapshot]:
        wanted: dict[tuple[str, str], Key] = {}
        for key in keys:
            wanted[_item_key(key)] = key  # also drops repeats: BatchGetItem refuses them
        pairs = list(wanted)
        chunks = [pairs[i : i + BATCH_GET_LIMIT] for i in range(0, len(pairs), BATCH_GET_LIMIT)]
        out: dict[Key, Snapshot] = dict.fromkeys(wanted.values(), EMPTY)
        bad: dict[Key, str] = {}
        tasks = [asyncio.ensure_future(self._batch_get(c)) for c in chunks]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            # One chunk failed (or we were cancelled): stop its siblings rather than leave them
            # running unowned, holding the concurrency semaphore.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        for items in results:
            for item in items:
                try:
                    key = wanted[(item["pk"]["S"], item["sk"]["S"])]
                except (KeyError, TypeError):
                    continue  # not an item we asked for
                try:
                    out[key] = _snapshot(item)
                except (StorageError, KeyError, TypeError, ValueError, AttributeError) as exc:
                    bad[key] = f"dynamodb: undecodable item {_describe(key)}: {exc!r}"[:300]
        if bad:
            for key in bad:
                out.pop(key, None)
            raise BadItems(out, bad)
        return out

    async def _batch_get(
        self, pairs: list[tuple[str, str]], *, flush: bool = False
    ) -> list[dict[str, Any]]:
        """Consistent reads of ``pairs`` (at most 100), their ``UnprocessedKeys`` asked
        again (consistent too) with backoff: a seeding read through botocore under the
        reads' permits, or (``flush``) a flush's read-back on the wire under the writes'."""
        request: dict[str, Any] = {
            self.table: {
                "Keys": [{"pk": {"S": pk}, "sk": {"S": sk}} for pk, sk in pairs],
                "ConsistentRead": True,
            }
        }
        items: list[dict[str, Any]] = []
        for attempt in range(10):
            if flush:
                resp = await self._wire_call(
                    "BatchGetItem", "a flush's read-back", {"RequestItems": request}
                )
            else:
                resp = await self._call(
                    "batch_get_item", "batch get", _read=True, RequestItems=request
                )
            items.extend(resp.get("Responses", {}).get(self.table, []))
            request = resp.get("UnprocessedKeys") or {}
            if not request:
                return items
            for part in request.values():  # a retried read is consistent too, whatever came back
                part["ConsistentRead"] = True
            await asyncio.sleep(self._backoff(attempt))
        raise StorageUnavailable(f"dynamodb: {len(request[self.table]['Keys'])} keys unprocessed")

    # -- gauges (docs/dimensions.md) ----------------------------------------------------------
    # A gauge is an item of its own (``gauge_key``): ``t`` its value, ``ga`` (N) and ``gn``
    # (S) the reading's time (ms) and node, ``ttl`` as a counter's. One UpdateItem a reading,
    # on the condition that it wins over the stored one; a refused condition is answered with
    # the stored item.

    async def put_gauges(
        self, items: Sequence[tuple[Key, str, GaugeReading]]
    ) -> dict[Key, GaugeReading | StorageError]:
        """One conditional ``UpdateItem`` per reading, concurrently."""
        keyed = list(items)
        got = await asyncio.gather(*(self._put_gauge(*item) for item in keyed))
        return {item[0]: outcome for item, outcome in zip(keyed, got, strict=True)}

    async def _put_gauge(
        self, key: Key, kind: str, reading: GaugeReading
    ) -> GaugeReading | StorageError:
        try:
            pk, sk = _item_key(gauge_key(key))
        except StoragePermanentError as exc:
            return exc
        value, at_ms, node = reading
        # The order of :func:`storage.base.reading_wins`, spelled out.
        later = "#ga < :a OR (#ga = :a AND #gn < :n)"
        condition = (
            f"attribute_not_exists(#t) OR #t < :v OR "
            f"(#t = :v AND (attribute_not_exists(#ga) OR {later}))"
            if kind == "max"
            else f"attribute_not_exists(#ga) OR {later} OR (#ga = :a AND #gn = :n AND #t < :v)"
        )
        try:
            await self._call(
                "update_item",
                f"gauge {_describe(key)}",
                TableName=self.table,
                Key={"pk": {"S": pk}, "sk": {"S": sk}},
                UpdateExpression="SET #t = :v, #ga = :a, #gn = :n, #ttl = :ttl",
                ConditionExpression=condition,
                ExpressionAttributeNames={"#t": "t", "#ga": "ga", "#gn": "gn", "#ttl": "ttl"},
                ExpressionAttributeValues={
                    ":v": {"N": str(value)},
                    ":a": {"N": str(at_ms)},
                    ":n": {"S": node},
                    ":ttl": {"N": str(_ttl(key[2], self.retention_days))},
                },
                ReturnValuesOnConditionCheckFailure="ALL_OLD",
            )
            return reading
        except _ConditionFailed as refused:  # a stored reading wins: answered with it
            if refused.item:
                try:
                    return _reading(refused.item)
                except StorageError as exc:  # (this key only)
                    return exc
        except StorageError as exc:
            return exc
        try:
            return (await self.load_gauges([key]))[key] or reading
        except StorageError as exc:
            return exc

    async def load_gauges(self, keys: Sequence[Key]) -> dict[Key, GaugeReading | None]:
        """Consistent ``GetItem``s, concurrently."""

        async def one(key: Key) -> GaugeReading | None:
            pk, sk = _item_key(gauge_key(key))
            resp = await self._call(
                "get_item",
                f"gauge {_describe(key)}",
                TableName=self.table,
                Key={"pk": {"S": pk}, "sk": {"S": sk}},
                ConsistentRead=True,
            )
            item = resp.get("Item")
            return None if item is None else _reading(item)

        keyed = list(keys)
        got = await asyncio.gather(*(one(key) for key in keyed))
        return dict(zip(keyed, got, strict=True))

    async def list_period(self, tenant: str, period: str) -> dict[str, Snapshot]:
        return await self._list(tenant, period, None)

    async def list_between(
        self, tenant: str, period: str, first: str, last: str
    ) -> dict[str, Snapshot]:
        """One Query: ``sk BETWEEN "<period>#<first>" AND "<period>#<last>"``."""
        return await self._list(tenant, period, (first, last))

    async def _list(
        self, tenant: str, period: str, between: tuple[str, str] | None
    ) -> dict[str, Snapshot]:
        _check_period(period)
        prefix = period + "#"
        pk, _ = _item_key((tenant, "", period))
        values: dict[str, Any] = {":pk": {"S": pk}}
        if between is None:
            condition = "pk = :pk AND begins_with(sk, :p)"
            values[":p"] = {"S": prefix}
        else:
            condition = "pk = :pk AND sk BETWEEN :lo AND :hi"
            values[":lo"] = {"S": prefix + between[0]}
            values[":hi"] = {"S": prefix + between[1]}
        query: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": condition,
            "ExpressionAttributeValues": values,
            "ConsistentRead": True,
        }
        if self.page_size is not None:
            query["Limit"] = self.page_size
        out: dict[str, Snapshot] = {}
        what = f"query {tenant!r} {period}"
        while True:
            resp = await self._call("query", what, **query)
            for item in resp.get("Items", []):
                out[item["sk"]["S"][len(prefix) :]] = _snapshot(item)
            last = resp.get("LastEvaluatedKey")
            if not last:
                return out
            query["ExclusiveStartKey"] = last

    # -- history (docs/history.md) -----------------------------------------------------------

    async def day_buckets(self, tenant: str, feature: str, first: str, last: str) -> dict[str, int]:
        """One Query: ``sk BETWEEN "#d#<feature>#<first>" AND "#d#<feature>#<last>"``."""
        first, last = check_range(first, last)
        if len(first) != 10:
            raise StoragePermanentError(f"day buckets are read by days, got {first!r}")
        prefix = f"{_DAY_SK}{feature}#"
        items = await self._query_between(
            tenant, prefix + first, prefix + last + DAYS_END, "day buckets"
        )
        out: dict[str, int] = {}
        for item in items:
            day = item["sk"]["S"][len(prefix) :]
            if "#" in day:  # another feature's whose name goes on with "#..." (a '#' in a
                continue  # dimension value): inside the range, not one of this feature's days
            out[day] = _number(item["t"]) if "t" in item else 0
        return out

    async def counters_between(
        self, tenant: str, feature: str, first: str, last: str
    ) -> dict[str, int]:
        """One Query: ``sk BETWEEN "<first>#" AND "<last>#~"``, every feature's counters of
        the tenant in the range (a month range also holds the day counters of its months but
        the last): ``feature``'s of ``first``'s shape are kept."""
        first, last = check_range(first, last)
        items = await self._query_between(
            tenant, first + "#", last + "#" + _SK_END, "counter range"
        )
        out: dict[str, int] = {}
        for item in items:
            period, _, name = item["sk"]["S"].partition("#")
            if name == feature and len(period) == len(first):
                out[period] = _number(item["t"]) if "t" in item else 0
        return out

    async def _query_between(
        self, tenant: str, low: str, high: str, what: str
    ) -> list[dict[str, Any]]:
        if not tenant or len(tenant.encode("utf-8")) > MAX_PK_BYTES:
            raise StoragePermanentError("dynamodb: tenant is empty or too long")
        query: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": "pk = :pk AND sk BETWEEN :lo AND :hi",
            "ExpressionAttributeValues": {
                ":pk": {"S": tenant},
                ":lo": {"S": low},
                ":hi": {"S": high},
            },
            "ProjectionExpression": "sk, #t",
            "ExpressionAttributeNames": {"#t": "t"},
            "ConsistentRead": True,
        }
        if self.page_size is not None:
            query["Limit"] = self.page_size
        items: list[dict[str, Any]] = []
        while True:
            resp = await self._call("query", f"{what} of {tenant[:80]!r}", **query)
            items.extend(resp.get("Items", []))
            last = resp.get("LastEvaluatedKey")
            if not last:
                return items
            query["ExclusiveStartKey"] = last

    async def export_page(self, period: str, cursor: str | None, limit: int) -> ExportPage:
        """A page of a parallel ``Scan`` (``export_segments`` segments, scanned concurrently)
        filtered to ``period``'s items. The layout has no key that starts with the period, so
        there is no Query for it; each segment's scan position is kept in the cursor.

        Every page asks each unfinished segment (at most ``limit`` of them) for its share of
        ``limit`` items: ``Limit`` bounds the items a Scan reads, and the filter only drops
        some, so a page holds at most ``limit`` rows (fewer, even none, where other periods'
        items were read)."""
        check_period(period)
        check_export_limit(limit)
        if cursor is None:
            states: list[Any] = [0] * self.export_segments
        else:
            states = _scan_states(decode_cursor(cursor), period)
        total = len(states)
        active = [i for i, st in enumerate(states) if st != 1][:limit]
        prefix = period + "#"
        shares = [limit // len(active) + (j < limit % len(active)) for j in range(len(active))]
        pages = await asyncio.gather(
            *(
                self._scan_segment(i, total, states[i], prefix, n)
                for i, n in zip(active, shares, strict=True)
            )
        )
        rows: list[ExportRow] = []
        for i, (items, last) in zip(active, pages, strict=True):
            states[i] = 1 if last is None else last
            for item in items:
                rows.append(_export_row(item, prefix, period))
        done = sum(1 for st in states if st == 1)
        next_cursor = None if done == total else encode_cursor(["d", period, states])
        return ExportPage(rows, next_cursor, total, done)

    async def _scan_segment(
        self, segment: int, total: int, start: Any, prefix: str, limit: int
    ) -> tuple[list[dict[str, Any]], dict[str, str] | None]:
        """One Scan request of ``segment``: its items of the period and where it stopped
        (``None``: the segment is done)."""
        scan: dict[str, Any] = {
            "TableName": self.table,
            "Segment": segment,
            "TotalSegments": total,
            "Limit": limit,
            "ConsistentRead": True,
            "FilterExpression": "begins_with(sk, :p)",
            "ProjectionExpression": "pk, sk, #t",
            "ExpressionAttributeNames": {"#t": "t"},
            "ExpressionAttributeValues": {":p": {"S": prefix}},
        }
        if start != 0:
            scan["ExclusiveStartKey"] = {"pk": {"S": start["pk"]}, "sk": {"S": start["sk"]}}
        resp = await self._call("scan", f"scan segment {segment}/{total} for {prefix[:-1]}", **scan)
        last = resp.get("LastEvaluatedKey")
        try:
            stop = None if not last else {"pk": last["pk"]["S"], "sk": last["sk"]["S"]}
        except (KeyError, TypeError) as exc:
            raise StoragePermanentError(f"dynamodb: unexpected LastEvaluatedKey {last!r}") from exc
        return resp.get("Items", []), stop

    # -- limits (docs/quotas.md) -----------------------------------------------------------

    async def limits_version(self) -> int:
        """A consistent ``GetItem`` of the limits' version item."""
        resp = await self._call(
            "get_item",
            "limits version",
            TableName=self.table,
            Key=_LIMITS_VERSION_KEY,
            ConsistentRead=True,
        )
        item = resp.get("Item")
        return 0 if item is None or "v" not in item else _number(item["v"])

    async def read_limits(self) -> tuple[int, list[tuple[str, str, str, str]]]:
        """The version, then every record (a consistent query of the ``lim#`` items).

        A change landing between the two reads shows in the records and not in the version:
        the node reads again when it sees the newer version, so it never keeps a newer version
        with older records."""
        version = await self.limits_version()
        query: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": "pk = :pk AND begins_with(sk, :p)",
            "ExpressionAttributeValues": {":pk": {"S": OWNER_PK}, ":p": {"S": _LIMIT_SK}},
            "ConsistentRead": True,
        }
        out: list[tuple[str, str, str, str]] = []
        while True:
            resp = await self._call("query", "limits", **query)
            for item in resp.get("Items", []):
                try:
                    feature = item["f"]["S"] if "f" in item else ""
                    out.append((item["sc"]["S"], item["n"]["S"], feature, item["b"]["S"]))
                except (KeyError, TypeError):
                    log.warning("dynamodb: undecodable limits item %r skipped", item.get("sk"))
            last = resp.get("LastEvaluatedKey")
            if not last:
                return version, out
            query["ExclusiveStartKey"] = last

    async def write_limit(
        self, scope: str, name: str, feature: str, body: str | None, expect: int | None = None
    ) -> int:
        """One ``TransactWriteItems``: the record, and the version moved from the one just
        read (``expect``, if given) to the next under a condition; a concurrent change
        cancels it and it is tried again on the new version (with ``expect``: VersionMoved)."""
        key = {"pk": {"S": OWNER_PK}, "sk": {"S": f"{_LIMIT_SK}{scope}#{name}#{feature}"}}
        op: dict[str, Any]
        if body is None:
            op = {"Delete": {"TableName": self.table, "Key": key}}
        else:
            item = {**key, "sc": {"S": scope}, "n": {"S": name}, "b": {"S": body}}
            if feature:  # (an empty string is refused by older DynamoDB Local builds)
                item["f"] = {"S": feature}
            op = {"Put": {"TableName": self.table, "Item": item}}
        for attempt in range(8):
            old = await self.limits_version() if expect is None else expect
            bump = {
                "Update": {
                    "TableName": self.table,
                    "Key": _LIMITS_VERSION_KEY,
                    "UpdateExpression": "SET v = :new",
                    "ConditionExpression": "attribute_not_exists(v) OR v = :old",
                    "ExpressionAttributeValues": {
                        ":new": {"N": str(old + 1)},
                        ":old": {"N": str(old)},
                    },
                }
            }
            try:
                await self._call(
                    "transact_write_items",
                    "limits change",
                    # Retried with the version read again, by this loop, not with a stale one.
                    _raise=_CONTENDED,
                    TransactItems=[op, bump],
                )
                return old + 1
            except StoragePermanentError as exc:
                cause = exc.__cause__
                if not isinstance(cause, ClientError) or not _contended(cause):
                    raise
                if expect is not None:
                    raise VersionMoved(
                        f"dynamodb: limits are no longer at version {expect}"
                    ) from None
            await asyncio.sleep(self._backoff(attempt))
        raise StorageUnavailable("dynamodb: limits change: the version kept changing; retry")

    # -- strict budgets (ADR 0009) -----------------------------------------------------------

    async def budget_read(self, key: Key) -> BudgetItem:
        """A consistent ``GetItem`` of the counter's budget item."""
        resp = await self._call(
            "get_item",
            "budget read",
            TableName=self.table,
            Key=_budget_key(key),
            ConsistentRead=True,
        )
        item = resp.get("Item")
        return BudgetItem(0, None) if item is None else _budget_item(item, key)

    async def budget_swap(self, key: Key, version: int, body: str) -> bool:
        """One ``PutItem`` on the condition that the stored version is ``version``. The item
        is replaced whole: the units admitted onto the old body go with it (the writer
        folded them in)."""
        item = {
            **_budget_key(key),
            "v": {"N": str(version + 1)},
            "b": {"S": body},
            "gv": {"S": _body_tag(body)},
            "adt": {"N": "0"},
        }
        if key[2]:  # a record with no period (a credit pool) never expires
            item["ttl"] = {"N": str(_ttl(key[2], self.retention_days))}
        params: dict[str, Any] = {"TableName": self.table, "Item": item}
        if version == 0:
            params["ConditionExpression"] = "attribute_not_exists(v)"
        else:
            params["ConditionExpression"] = "v = :v"
            params["ExpressionAttributeValues"] = {":v": {"N": str(version)}}
        try:
            await self._call("put_item", "budget write", **params)
        except _ConditionFailed:
            return False
        return True

    async def budget_admit(
        self, key: Key, body: str, name: str, units: int, most: int, op: str
    ) -> BudgetItem | None:
        """One conditional ``UpdateItem`` (``ALL_NEW``): ``adt`` (the units admitted onto
        the body, in all) and ``u#<name>`` up by ``units``, ``o#<name>`` := ``op``, the
        version on by one; if ``gv`` (a digest of the body) is that of ``body`` or there is
        no item (then it is made with ``body``), ``adt <= most - units`` and ``o#<name>`` is
        not ``op``."""
        if units <= 0 or units > most:
            return None
        values: dict[str, Any] = {
            ":q": {"N": str(units)},
            ":zero": {"N": "0"},
            ":one": {"N": "1"},
            ":op": {"S": op},
            ":body": {"S": body},
            ":gv": {"S": _body_tag(body)},
            ":room": {"N": str(most - units)},
        }
        names = {"#u": _ADMITTED_UNITS + name, "#o": _ADMITTED_OP + name}
        made = (
            "SET b = if_not_exists(b, :body), gv = if_not_exists(gv, :gv),"
            " v = if_not_exists(v, :zero) + :one, adt = if_not_exists(adt, :zero) + :q,"
            " #u = if_not_exists(#u, :zero) + :q, #o = :op"
        )
        if key[2]:
            made += ", #ttl = if_not_exists(#ttl, :ttl)"
            names["#ttl"] = "ttl"
            values[":ttl"] = {"N": str(_ttl(key[2], self.retention_days))}
        try:
            resp = await self._call(
                "update_item",
                "budget admit",
                TableName=self.table,
                Key=_budget_key(key),
                UpdateExpression=made,
                ConditionExpression=(
                    "(attribute_not_exists(v) OR (gv = :gv AND adt <= :room))"
                    " AND (attribute_not_exists(#o) OR #o <> :op)"
                ),
                ExpressionAttributeNames=names,
                ExpressionAttributeValues=values,
                ReturnValues="ALL_NEW",
            )
        except _ConditionFailed:
            return None
        return _budget_item(resp["Attributes"], key)

    # -- threshold alerts (docs/quotas.md) --------------------------------------------------

    async def claim_alert(self, alert_id: str, body: str) -> bool:
        """A ``PutItem`` conditioned on ``attribute_not_exists(pk)``. A refused condition (held
        already, perhaps by an earlier try of this very call whose answer was lost and that
        ``_call`` sent again) and a failure that leaves it unknown whether the put landed are
        both settled by a consistent read: True only if the stored body is ``body``."""
        if not alert_id or len(alert_id) > 256:
            raise StoragePermanentError(
                f"dynamodb: alert id {alert_id[:64]!r} is empty or too long"
            )
        key = {"pk": {"S": OWNER_PK}, "sk": {"S": _ALERT_SK + alert_id}}
        try:
            await self._call(
                "put_item",
                "alert claim",
                TableName=self.table,
                # Expires with the counters: the retention after the longest period (a month).
                Item={**key, "b": {"S": body}, "ttl": {"N": str(_alert_ttl(self.retention_days))}},
                ConditionExpression="attribute_not_exists(pk)",
            )
            return True
        except _ConditionFailed:
            pass
        except StorageUnavailable:
            pass  # landed or not: the read below tells (and raises if it cannot)
        resp = await self._call(
            "get_item", "alert claim", TableName=self.table, Key=key, ConsistentRead=True
        )
        item = resp.get("Item")
        if item is None:
            raise StorageUnavailable("dynamodb: alert claim: not stored; try again")
        stored = item.get("b", {}).get("S")
        return bool(stored == body)

    async def cluster_setting(self, name: str, value: str) -> str:
        """A ``PutItem`` conditioned on ``attribute_not_exists(pk)``, then a consistent read
        of what is stored (whichever put landed first)."""
        key = {"pk": {"S": OWNER_PK}, "sk": {"S": _SETTING_SK + name}}
        with contextlib.suppress(_ConditionFailed, StorageUnavailable):  # (the read tells)
            await self._call(
                "put_item",
                "cluster setting",
                TableName=self.table,
                Item={**key, "b": {"S": value}},
                ConditionExpression="attribute_not_exists(pk)",
            )
        resp = await self._call(
            "get_item", "cluster setting", TableName=self.table, Key=key, ConsistentRead=True
        )
        stored = resp.get("Item", {}).get("b", {}).get("S")
        if not isinstance(stored, str):
            raise StorageUnavailable(f"dynamodb: cluster setting {name}: not stored; try again")
        return stored

    # -- unique values (docs/storage.md, "Unique values") ------------------------------------

    async def claim_value(self, key: Key, value: str, claimant: str) -> str:
        """One ``PutItem`` conditioned on ``attribute_not_exists(pk)``. A refused condition
        (held already, perhaps by an earlier try of this very call whose answer was lost and
        that ``_call`` sent again) is answered with the stored claimant: from ``ALL_OLD``, or a
        consistent ``GetItem`` where none comes back (DynamoDB Local)."""
        check_unique(key, value, claimant)
        pk, prefix = _values_prefix(key)
        item_key = {"pk": {"S": pk}, "sk": {"S": prefix + value}}
        what = f"value claim {_describe(key)}"
        try:
            await self._call(
                "put_item",
                what,
                TableName=self.table,
                Item={
                    **item_key,
                    "c": {"S": claimant},
                    "ttl": {"N": str(_ttl(key[2], self.retention_days))},
                },
                ConditionExpression="attribute_not_exists(pk)",
                ReturnValuesOnConditionCheckFailure="ALL_OLD",
            )
            return claimant
        except _ConditionFailed as refused:
            if refused.item:
                return _claimant(refused.item, what)
        stored = await self.claimant_of(key, value)
        if stored is None:  # (expired or deleted since the refusal)
            raise StorageUnavailable(f"dynamodb: {what}: not stored; try again")
        return stored

    async def claimant_of(self, key: Key, value: str) -> str | None:
        """One consistent ``GetItem`` of the value item."""
        check_value_of(key, value)
        pk, prefix = _values_prefix(key)
        what = f"value claim {_describe(key)}"
        resp = await self._call(
            "get_item",
            what,
            TableName=self.table,
            Key={"pk": {"S": pk}, "sk": {"S": prefix + value}},
            ConsistentRead=True,
        )
        item = resp.get("Item")
        return None if item is None else _claimant(item, what)

    async def void_value(self, key: Key, value: str, claimant: str) -> str | None:
        """One ``UpdateItem`` setting ``v`` conditioned on ``c = :claimant``; a refused
        condition (no item, or another claimant's) is answered with what is stored: from
        ``ALL_OLD``, or a consistent ``GetItem`` where none comes back."""
        check_unique(key, value, claimant)
        pk, prefix = _values_prefix(key)
        what = f"value void {_describe(key)}"
        try:
            await self._call(
                "update_item",
                what,
                TableName=self.table,
                Key={"pk": {"S": pk}, "sk": {"S": prefix + value}},
                UpdateExpression="SET v = :one",
                ConditionExpression="c = :c",
                ExpressionAttributeValues={":one": {"N": "1"}, ":c": {"S": claimant}},
                ReturnValuesOnConditionCheckFailure="ALL_OLD",
            )
            return claimant
        except _ConditionFailed as refused:
            if refused.item:
                return _claimant(refused.item, what)
        return await self.claimant_of(key, value)

    async def values_page(
        self, key: Key, cursor: str | None, limit: int
    ) -> tuple[list[str], str | None]:
        """One consistent Query: ``pk = :t AND begins_with(sk, "#u#<period>#<feature>\\x1f")``
        from after the cursor's value, ``Limit`` one more than asked for (whether a next page
        has any), voided values filtered out. A page cut short by DynamoDB's 1 MB, or holding
        voided values, holds fewer values and a cursor."""
        check_values_limit(limit)
        after = values_cursor(cursor)
        pk, prefix = _values_prefix(key)
        query: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": "pk = :pk AND begins_with(sk, :p)",
            "ExpressionAttributeValues": {":pk": {"S": pk}, ":p": {"S": prefix}},
            "ProjectionExpression": "sk",
            "FilterExpression": "attribute_not_exists(v)",
            "ConsistentRead": True,
            "Limit": limit + 1,
        }
        if after:  # (inside the key's range, and the sort-key limit: _values_prefix)
            query["ExclusiveStartKey"] = {"pk": {"S": pk}, "sk": {"S": prefix + after}}
        resp = await self._call("query", f"values of {_describe(key)}", **query)
        last = resp.get("LastEvaluatedKey")
        try:
            got = [str(item["sk"]["S"])[len(prefix) :] for item in resp.get("Items", [])]
            read_to = str(last["sk"]["S"])[len(prefix) :] if last else None
        except (KeyError, TypeError) as exc:
            raise StoragePermanentError(f"dynamodb: undecodable value of {_describe(key)}") from exc
        if len(got) > limit:
            return got[:limit], next_values_cursor(got[:limit], True)
        # (the last value read, voided or not: a page of voided values only goes on from it)
        return got, next_values_cursor([read_to], True) if read_to else None

    # -- period marks (docs/storage.md, "Period marks") --------------------------------------

    async def mark_period_open(
        self, period: str, node: str, at: float, by: str | None = None
    ) -> PeriodMark:
        """One ``PutItem`` conditioned on ``attribute_not_exists(pk) OR #s = :drained``; a
        refused condition (an open or closed mark there already, perhaps this very call's
        earlier try that ``_call`` sent again) is answered with the stored mark: from
        ``ALL_OLD``, or a consistent ``GetItem`` where none comes back (DynamoDB Local)."""
        mark = check_period_mark(period, node, at, by or node, MARK_OPEN)
        held = await self._put_mark(
            period,
            mark,
            "attribute_not_exists(pk) OR #s = :drained",
            {":drained": {"S": MARK_DRAINED}},
            "open",
            frozenset({None, MARK_DRAINED}),
        )
        assert held is not None  # (where no mark is, an open is written)
        return held

    async def mark_period_closed(
        self, period: str, node: str, at: float, by: str, units: dict[str, int] | None = None
    ) -> PeriodMark:
        """One ``PutItem`` conditioned on ``attribute_not_exists(pk) OR #s <> :closed``; a
        refused condition is answered with the stored (closed) mark, as an open's is."""
        mark = check_period_mark(period, node, at, by, MARK_CLOSED, units)
        held = await self._put_mark(
            period,
            mark,
            "attribute_not_exists(pk) OR #s <> :closed",
            {":closed": {"S": MARK_CLOSED}},
            "close",
            frozenset({None, MARK_OPEN, MARK_DRAINED}),
        )
        assert held is not None  # (where no mark is, a close is written)
        return held

    async def mark_period_drained(
        self, period: str, node: str, at: float, units: dict[str, int] | None = None
    ) -> PeriodMark | None:
        """One ``PutItem`` conditioned on ``#s = :open``; a refused condition is answered with
        the stored (closed or drained) mark as an open's is, or ``None`` where no mark is."""
        mark = check_period_mark(period, node, at, node, MARK_DRAINED, units)
        return await self._put_mark(
            period,
            mark,
            "#s = :open",
            {":open": {"S": MARK_OPEN}},
            "drain",
            frozenset({MARK_OPEN}),
        )

    async def period_marks(self, period: str) -> list[PeriodMark]:
        """A consistent ``Query`` of the period's partition, paginated."""
        check_period(period)
        query: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": "pk = :pk",
            "ExpressionAttributeValues": {":pk": {"S": _MARKS_PK + period}},
            "ConsistentRead": True,
        }
        if self.page_size is not None:
            query["Limit"] = self.page_size
        marks: list[PeriodMark] = []
        while True:
            resp = await self._call("query", f"marks of {period}", **query)
            marks.extend(_mark(item, period) for item in resp.get("Items", []))
            last = resp.get("LastEvaluatedKey")
            if not last:
                return sorted(marks, key=lambda m: m.node)
            query["ExclusiveStartKey"] = last

    async def _put_mark(
        self,
        period: str,
        mark: PeriodMark,
        condition: str,
        values: dict[str, Any],
        doing: str,
        replaces: frozenset[str | None],
    ) -> PeriodMark | None:
        """``mark`` written by a ``PutItem`` on ``condition`` (true where the stored state is
        one of ``replaces``, ``None`` standing for no mark), or the stored mark that refused
        it (``None``: none). A refusal with no ``ALL_OLD`` is read back with a consistent
        ``GetItem``; if that read finds a state the write replaces (the mark changed between
        the two), the write is tried again, so the answer is the write or a state refusing
        it."""
        key = {"pk": {"S": _MARKS_PK + period}, "sk": {"S": mark.node}}
        what = f"period {doing} of {mark.node!r} in {period}"
        params: dict[str, Any] = {
            "TableName": self.table,
            "Item": {
                **key,
                "state": {"S": mark.state},
                "at": {"N": repr(mark.at)},
                "by": {"S": mark.by},
                "ttl": {"N": str(_ttl(period, self.retention_days))},
            },
            "ConditionExpression": condition,
            "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
        }
        units = mark_units_to_text(mark.units)
        if units is not None:
            params["Item"]["u"] = {"S": units}
        if "#s" in condition:
            params["ExpressionAttributeNames"] = {"#s": "state"}
        if values:
            params["ExpressionAttributeValues"] = values
        for _ in range(_MARK_TRIES):
            try:
                await self._call("put_item", what, **params)
                return mark
            except _ConditionFailed as refused:
                if refused.item:
                    held: PeriodMark | None = _mark(refused.item, period)
                else:
                    resp = await self._call(
                        "get_item", what, TableName=self.table, Key=key, ConsistentRead=True
                    )
                    item = resp.get("Item")
                    held = None if item is None else _mark(item, period)
            if (None if held is None else held.state) not in replaces:
                return held
        raise StorageUnavailable(f"dynamodb: {what}: the mark kept changing; try again")

    # -- credits ledgers (docs/ledger.md) ----------------------------------------------------

    async def ledger_read(self, tenant: str) -> tuple[int, str | None]:
        """A consistent ``GetItem`` of the balance item."""
        resp = await self._call(
            "get_item",
            "ledger read",
            TableName=self.table,
            Key=_ledger_key(tenant, _LEDGER_BALANCE_SK),
            ConsistentRead=True,
        )
        item = resp.get("Item")
        if item is None:
            return 0, None
        try:
            return _number(item["v"]), item["b"]["S"]
        except (KeyError, TypeError) as exc:
            raise StoragePermanentError(f"dynamodb: undecodable ledger of {tenant!r}") from exc

    async def ledger_write(
        self,
        tenant: str,
        version: int,
        body: str,
        entries: Sequence[LedgerRow],
        refs: Sequence[tuple[str, str]] = (),
    ) -> bool:
        """One ``TransactWriteItems``: the balance item on the condition of its version, each
        ref, entry and timeline item on the condition that it does not exist. A cancellation
        for those conditions (or a conflicting transaction) is ``False``; any other reason is
        raised."""
        if len(entries) > self.ledger_max_entries or len(refs) > 1:
            raise StoragePermanentError(
                f"dynamodb: a ledger write of {len(entries)} entries is too large"
            )
        balance: dict[str, Any] = {
            "Put": {
                "TableName": self.table,
                "Item": {
                    **_ledger_key(tenant, _LEDGER_BALANCE_SK),
                    "v": {"N": str(version + 1)},
                    "b": {"S": body},
                },
            }
        }
        if version == 0:
            balance["Put"]["ConditionExpression"] = "attribute_not_exists(v)"
        else:
            balance["Put"]["ConditionExpression"] = "v = :v"
            balance["Put"]["ExpressionAttributeValues"] = {":v": {"N": str(version)}}
        ops = [balance]
        for ref, ref_body in refs:
            ops.append(_put_new(self.table, _ledger_key(tenant, _LEDGER_REF_SK + ref), ref_body))
        for seq, entry_body, at_ms in entries:
            ops.append(_put_new(self.table, _ledger_key(tenant, _entry_sk(seq)), entry_body))
            where = {"pk": {"S": _timeline_pk(tenant)},
                     "sk": {"S": timeline_position(at_ms, tenant, seq)},
                     "t": {"S": tenant}, "s": {"N": str(seq)}}  # fmt: skip
            ops.append(_put_new(self.table, where, entry_body))
        try:
            await self._call(
                "transact_write_items",
                "ledger write",
                _raise=_CANCELLED,
                TransactItems=ops,
            )
        except StoragePermanentError as exc:
            cause = exc.__cause__
            if isinstance(cause, ClientError) and _cancelled_by_conditions(cause):
                return False
            raise
        return True

    async def ledger_ref(self, tenant: str, ref: str) -> str | None:
        """A consistent ``GetItem`` of the ref item."""
        resp = await self._call(
            "get_item",
            "ledger ref read",
            TableName=self.table,
            Key=_ledger_key(tenant, _LEDGER_REF_SK + ref),
            ConsistentRead=True,
        )
        item = resp.get("Item")
        if item is None:
            return None
        try:
            return str(item["b"]["S"])
        except (KeyError, TypeError) as exc:
            raise StoragePermanentError(f"dynamodb: undecodable ledger ref {ref!r}") from exc

    async def children_page(
        self, parent: str, feature: str, period: str, after: str | None, limit: int
    ) -> tuple[list[tuple[str, int]], bool]:
        """One ``Query`` of the ``children`` index (eventually consistent, as every global
        secondary index is: a write shows there within about a second), in pages of
        DynamoDB's own until ``limit`` + 1 items are read or the range ends."""
        check_children(parent, feature, period, after, limit)
        low = f"{period}#{after}" if after is not None else f"{period}#"
        query: dict[str, Any] = {
            "TableName": self.table,
            "IndexName": CHILDREN_INDEX,
            "KeyConditionExpression": "cp = :cp AND cs BETWEEN :lo AND :hi",
            "ExpressionAttributeValues": {
                ":cp": {"S": f"{parent}#{feature}"},
                ":lo": {"S": low},
                ":hi": {"S": f"{period}$"},
            },
        }
        out: list[tuple[str, int]] = []
        while len(out) <= limit:
            query["Limit"] = limit + 1 - len(out) + (after is not None)
            try:
                resp = await self._call("query", f"the children of {parent[:80]}", **query)
            except StoragePermanentError as exc:
                text = str(exc).lower()
                if "specified index" not in text and "backfilling" not in text:
                    raise
                raise StorageUnavailable(
                    f"dynamodb: the {CHILDREN_INDEX} index of table {self.table} cannot be "
                    f"read yet ({exc}): run `meter storage init`, and wait until it reports "
                    "the index ACTIVE"
                ) from exc
            for item in resp.get("Items", []):
                try:
                    tenant = item["cs"]["S"][len(period) + 1 :]
                    total = _number(item["t"])
                except (KeyError, TypeError) as exc:
                    raise StoragePermanentError("dynamodb: undecodable children item") from exc
                if tenant != after:  # (BETWEEN takes in the item after names)
                    out.append((tenant, total))
            last = resp.get("LastEvaluatedKey")
            if not last:
                break
            query["ExclusiveStartKey"] = last
        return out[:limit], len(out) > limit

    async def ledger_timeline(
        self, start_ms: int, end_ms: int, after: str | None, limit: int
    ) -> tuple[list[tuple[str, int, str]], str | None]:
        """A consistent ``Query`` of each timeline partition's range (at once), a share of the
        page each (twice ``limit`` over the partitions), merged. Up to a partition that may
        hold more (it filled its share), the merge is complete: the page stops at the first
        such partition's last item, so a page may hold fewer than ``limit`` (never none while
        more remain); a page reads about twice ``limit`` items, whatever the partitions."""
        lo, hi = timeline_range(start_ms, end_ms, after)
        if lo >= hi:
            return [], None
        share = max(2, -(-2 * (limit + 1) // TIMELINE_PARTITIONS))
        parts = await asyncio.gather(  # (one more than the share: a partition that has it
            *(self._timeline_part(k, lo, hi, share + 1) for k in range(TIMELINE_PARTITIONS))
        )  # holds more past its share's last item, which is its frontier)
        frontier = min((part[share - 1][0] for part in parts if len(part) > share), default=None)
        merged = sorted(row for part in parts for row in part)
        if frontier is not None:
            merged = [row for row in merged if row[0] <= frontier]
        page = [(t, s, b) for _, t, s, b in merged[:limit]]
        more = frontier is not None or len(merged) > limit
        return page, (merged[len(page) - 1][0] if more else None)

    async def _timeline_part(
        self, k: int, lo: str, hi: str, limit: int
    ) -> list[tuple[str, str, int, str]]:
        """Up to ``limit`` items of timeline partition ``k`` in ``lo .. hi``: ``(position,
        tenant, seq, body)``."""
        query: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": "pk = :pk AND sk BETWEEN :lo AND :hi",
            "ExpressionAttributeValues": {
                ":pk": {"S": f"{_TIMELINE_PK}{k}"},
                ":lo": {"S": lo},
                ":hi": {"S": hi},
            },
            "ConsistentRead": True,
        }
        out: list[tuple[str, str, int, str]] = []
        while len(out) < limit:
            query["Limit"] = limit - len(out)
            resp = await self._call("query", "ledger timeline", **query)
            for item in resp.get("Items", []):
                try:
                    out.append((item["sk"]["S"], item["t"]["S"], int(item["s"]["N"]),
                                item["b"]["S"]))  # fmt: skip
                except (KeyError, TypeError, ValueError) as exc:
                    raise StoragePermanentError("dynamodb: undecodable timeline item") from exc
            last = resp.get("LastEvaluatedKey")
            if not last:
                break
            query["ExclusiveStartKey"] = last
        return out

    async def ledger_entries(self, tenant: str, after: int, limit: int) -> list[tuple[int, str]]:
        """A consistent ``Query`` of the entry items after ``after``, in sort key order."""
        query: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": "pk = :pk AND sk BETWEEN :lo AND :hi",
            "ExpressionAttributeValues": {
                ":pk": {"S": tenant},
                ":lo": {"S": _entry_sk(after + 1)},
                ":hi": {"S": _LEDGER_ENTRY_SK + "9" * 20},
            },
            "ConsistentRead": True,
            "Limit": limit,
        }
        out: list[tuple[int, str]] = []
        while len(out) < limit:
            query["Limit"] = limit - len(out)
            resp = await self._call("query", "ledger entries", **query)
            for item in resp.get("Items", []):
                try:
                    sk = item["sk"]["S"]
                    out.append((int(sk[len(_LEDGER_ENTRY_SK) :]), item["b"]["S"]))
                except (KeyError, TypeError, ValueError) as exc:
                    raise StoragePermanentError(
                        f"dynamodb: undecodable ledger entry of {tenant!r}"
                    ) from exc
            last = resp.get("LastEvaluatedKey")
            if not last:
                break
            query["ExclusiveStartKey"] = last
        return out

    # -- node id owners (ADR 0004) ---------------------------------------------------------

    async def claim_owner(
        self, node: str, token: str, *, lease_s: float, now: float, accept: Sequence[str] = ()
    ) -> Owner:
        """One conditional ``UpdateItem`` on the id's owner item; the holder if refused."""
        tokens = list(dict.fromkeys([token, *accept]))[:99]  # IN takes at most 100 operands
        names = [f":a{i}" for i in range(len(tokens))]
        values = {n: {"S": t} for n, t in zip(names, tokens, strict=True)}
        values[":now"] = {"N": str(round(now * 1000))}
        owner = await self._set_owner(
            node, token, now, lease_s, _CLAIM_CONDITION.format(", ".join(names)), values
        )
        assert owner is not None
        return owner

    async def renew_owner(
        self, node: str, token: str, *, lease_s: float, now: float, note: str | None = None
    ) -> Owner | None:
        """One conditional ``UpdateItem``: only the holder's token moves the lease (and sets
        the note, in the same write)."""
        check_owner_note(note)
        values = {":a0": {"S": token}}
        return await self._set_owner(node, token, now, lease_s, "#tok = :a0", values, note)

    async def owner(self, node: str) -> Owner | None:
        """A consistent ``GetItem`` of the id's owner item."""
        resp = await self._call(
            "get_item",
            f"owner of {node[:64]!r}",
            TableName=self.table,
            Key=_owner_key(node),
            ConsistentRead=True,
        )
        return _owner(resp.get("Item"))

    async def _set_owner(
        self,
        node: str,
        token: str,
        now: float,
        lease_s: float,
        condition: str,
        values: dict[str, Any],
        note: str | None = None,
    ) -> Owner | None:
        update = "SET #tok = :tok, #exp = :exp"
        names = {"#tok": "tok", "#exp": "exp"}
        if note is not None:
            update += ", #note = :note"
            names["#note"] = "note"
            values = {**values, ":note": {"S": note}}
        try:
            resp = await self._call(
                "update_item",
                f"owner of {node[:64]!r}",
                TableName=self.table,
                Key=_owner_key(node),
                UpdateExpression=update,
                ConditionExpression=condition,
                ExpressionAttributeNames=names,
                ExpressionAttributeValues={
                    **values,
                    ":tok": {"S": token},
                    ":exp": {"N": str(lease_end_ms(now, lease_s))},
                },
                ReturnValues="ALL_NEW",
                ReturnValuesOnConditionCheckFailure="ALL_OLD",
            )
            return _owner(resp["Attributes"])
        except _ConditionFailed as failed:
            if failed.item is not None and "tok" in failed.item:
                return _owner(failed.item)
            return await self.owner(node)  # DynamoDB Local returns no ALL_OLD

    # -- the boundary ------------------------------------------------------------------------

    async def _wire_call(self, op: str, what: str, params: dict[str, Any]) -> dict[str, Any]:
        """:meth:`_call`'s twin on the wire (:mod:`storage.dynamodb_wire`): the same
        request sent again on transient failures (a transaction with its token), every
        failure mapped to a StorageError; a cancelled transaction raises
        :class:`_Cancelled` with its reasons."""
        wire = self._wire
        if wire is None:
            raise StorageUnavailable("dynamodb: storage is not open")
        attempt = 0
        while True:
            try:
                async with self._sem:
                    self.calls[_WIRE_OPS.get(op, op)] += 1
                    return await wire.call(op, params)
            except WireError as exc:
                text = f"dynamodb: {what}: {exc.code}: {exc.message}"[:500]
                if exc.code in _CANCELLED:
                    raise _Cancelled(text, exc.reasons or _reasons_in(exc.message)) from exc
                if exc.code in _WIRE_RETRYABLE or exc.status >= 500 or exc.status == 429:
                    error: StorageError = StorageUnavailable(text)
                elif exc.code in OPERATOR_CODES:
                    raise StorageUnavailable(text) from exc
                else:
                    raise StoragePermanentError(text) from exc
            except NoCredentials as exc:
                raise StoragePermanentError(f"dynamodb: {what}: {exc}") from exc
            except aiohttp.ClientConnectorError as exc:
                # No connection at all: the endpoint is down. Fail fast, as _call does.
                raise StorageUnavailable(f"dynamodb: {what}: {exc}") from exc
            except TRANSPORT_ERRORS as exc:
                error = StorageUnavailable(f"dynamodb: {what}: {type(exc).__name__}: {exc}")
            except BotoCoreError as exc:  # refreshing credentials failed
                raise StorageUnavailable(f"dynamodb: {what}: {exc}") from exc
            attempt += 1
            if attempt >= self._wire_attempts:
                raise error
            await asyncio.sleep(self._backoff(attempt - 1))

    async def _call(
        self,
        op: str,
        what: str,
        _read: bool = False,
        _raise: frozenset[str] = frozenset(),
        **params: Any,
    ) -> dict[str, Any]:
        """Call ``op``, retrying transient failures; map every failure to a StorageError.
        ``_read``: a batch read, bounded by its own semaphore (not queued behind writes).
        ``_raise``: error codes not retried here but raised at once (as
        :class:`StoragePermanentError`), for a caller whose retry must change the request."""
        if self._client is None:
            raise StorageUnavailable("dynamodb: storage is not open")
        method = getattr(self._client, op)
        sem = self._read_sem if _read else self._sem
        attempt = 0
        while True:
            try:
                async with sem:
                    self.calls[op] += 1
                    resp: dict[str, Any] = await method(**params)
                return resp
            except ClientError as exc:
                code = _code(exc)
                if code == "ConditionalCheckFailedException":
                    raise _ConditionFailed(exc.response.get("Item")) from exc
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                message = exc.response.get("Error", {}).get("Message", str(exc))
                text = f"dynamodb: {what}: {code}: {message}"
                if code in _raise:
                    raise StoragePermanentError(text) from exc
                if code in RETRYABLE_CODES or status >= 500:
                    error: StorageError = StorageUnavailable(text)
                elif code in OPERATOR_CODES:
                    raise StorageUnavailable(text) from exc
                else:
                    raise StoragePermanentError(text) from exc
            except TRANSPORT_ERRORS as exc:
                error = StorageUnavailable(f"dynamodb: {what}: {type(exc).__name__}: {exc}")
                if isinstance(exc, EndpointConnectionError | ConnectTimeoutError):
                    # No connection at all (botocore already tried again): the endpoint is
                    # down. Fail fast - the node serves from memory and retries next flush.
                    raise error from exc
            except BotoCoreError as exc:  # parameter validation, bad config: never helps to retry
                raise StoragePermanentError(f"dynamodb: {what}: {exc}") from exc
            if attempt >= self.retries:
                raise error
            await asyncio.sleep(self._backoff(attempt))
            attempt += 1

    def _backoff(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2**attempt)]."""
        return random.uniform(0, min(self.backoff_cap, self.backoff_base * 2**attempt))


class _Cancelled(StorageError):
    """A cancelled transaction, with its reason code per item (``None``: not named)."""

    def __init__(self, text: str, reasons: list[str] | None) -> None:
        super().__init__(text)
        self.reasons = reasons


#: Retried on the wire: botocore's transient codes, and a transaction still in progress (its
#: own earlier send under the same token, not answered yet).
_WIRE_RETRYABLE = RETRYABLE_CODES | {"TransactionInProgressException"}
#: The wire's operations, counted under botocore's names in ``calls``.
_WIRE_OPS = {"TransactWriteItems": "transact_write_items", "BatchGetItem": "batch_get_item"}


class _Alone:
    """A transaction's answer that names no item's fate: its keys are written alone."""


_ALONE = _Alone()
_CONTENDED = frozenset({"TransactionConflictException"})
_CANCELLED = frozenset({"TransactionCanceledException"})
#: Most items in one TransactWriteItems: DynamoDB's, and DynamoDB Local's.
TRANSACT_LIMIT = 100
LOCAL_TRANSACT_LIMIT = 10
#: How deltas are flushed (the ``flush_mode`` setting, module doc).
FLUSH_MODES = ("single", "batched", "auto")
#: Sends of one apply's transactions, each with what the last cancellation left.
BATCH_ATTEMPTS = 6
#: ``auto``: seconds a key that met a conflicting write is written alone.
HOT_S = 30.0
#: Flush transactions in flight at once (each worker sends one after the other): enough to
#: keep DynamoDB busy, few enough that their answers never crowd the loop.
TRANSACT_WORKERS = 32
#: Keys of work between two hand-backs of the loop in a batched apply.
YIELD_EVERY = 500


def _cancel_reasons(exc: ClientError) -> list[str] | None:
    """The cancellation reason codes of a cancelled transaction, in item order."""
    reasons = exc.response.get("CancellationReasons")
    if isinstance(reasons, list):
        return [str(r.get("Code", "None")) if isinstance(r, dict) else "?" for r in reasons]
    return _reasons_in(str(exc.response.get("Error", {}).get("Message", "")))


def _reasons_in(text: str) -> list[str] | None:
    """The reason codes a cancellation's message names: older builds name them only there,
    ``... [None, ConditionalCheckFailed]``."""
    start, end = text.rfind("["), text.rfind("]")
    if start < 0 or end < start:
        return None
    return [c.strip() for c in text[start + 1 : end].split(",")]


def _cancelled_by_conditions(exc: ClientError) -> bool:
    """Whether a ledger write was cancelled only by its conditions or a conflicting
    transaction (then it wrote nothing and the caller reads again)."""
    if _code(exc) not in _CANCELLED:
        return False
    codes = _cancel_reasons(exc)
    if not codes:
        return False
    ok = ("None", "ConditionalCheckFailed", "TransactionConflict")
    return all(c in ok for c in codes) and any(c != "None" for c in codes)


def _ledger_key(tenant: str, sk: str) -> dict[str, Any]:
    if not tenant or len(tenant.encode("utf-8")) > MAX_PK_BYTES:
        raise StoragePermanentError("dynamodb: ledger tenant is empty or too long")
    return {"pk": {"S": tenant}, "sk": {"S": sk}}


def _timeline_pk(tenant: str) -> str:
    return f"{_TIMELINE_PK}{zlib.crc32(tenant.encode()) % TIMELINE_PARTITIONS}"


def _entry_sk(seq: int) -> str:
    return f"{_LEDGER_ENTRY_SK}{seq:020d}"


def _put_new(table: str, key: dict[str, Any], body: str) -> dict[str, Any]:
    return {
        "Put": {
            "TableName": table,
            "Item": {**key, "b": {"S": body}},
            "ConditionExpression": "attribute_not_exists(pk)",
        }
    }


def _contended(exc: ClientError) -> bool:
    """Whether a limits change failed because another change raced it (then it is tried
    again on the new version): a transaction conflict, or a cancellation whose only reasons
    are the version's condition and conflicts. Any other reason (a validation error, an item
    too large) would fail again: it is not retried."""
    code = _code(exc)
    if code in _CONTENDED:
        return True
    if code != "TransactionCanceledException":
        return False
    codes = _cancel_reasons(exc)
    if codes is None:
        return False
    # [record, version]: the record's own condition-free write never fails its condition.
    if len(codes) != 2 or codes[0] not in ("None", "TransactionConflict"):
        return False
    return codes[1] in ("ConditionalCheckFailed", "TransactionConflict") or (
        codes[0] == "TransactionConflict" and codes[1] == "None"
    )


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host == "localhost" or host == "::1" or host.startswith("127.")


#: The table's key, and its attributes' types (the index's are added to them).
TABLE_KEYS = [
    {"AttributeName": "pk", "KeyType": "HASH"},
    {"AttributeName": "sk", "KeyType": "RANGE"},
]
TABLE_ATTRIBUTES = [
    {"AttributeName": "pk", "AttributeType": "S"},
    {"AttributeName": "sk", "AttributeType": "S"},
]
_CHILDREN_ATTRIBUTES = [
    {"AttributeName": "cp", "AttributeType": "S"},
    {"AttributeName": "cs", "AttributeType": "S"},
]
_CHILDREN_GSI: dict[str, Any] = {
    "IndexName": CHILDREN_INDEX,
    "KeySchema": [
        {"AttributeName": "cp", "KeyType": "HASH"},
        {"AttributeName": "cs", "KeyType": "RANGE"},
    ],
    "Projection": {"ProjectionType": "INCLUDE", "NonKeyAttributes": ["t"]},
}


def _index_status(desc: dict[str, Any]) -> str | None:
    """The ``children`` index's status in a ``DescribeTable`` answer (``None``: none)."""
    for index in desc["Table"].get("GlobalSecondaryIndexes", ()):
        if index.get("IndexName") == CHILDREN_INDEX:
            return str(index.get("IndexStatus", "ACTIVE"))
    return None


def _describe(key: Key) -> str:
    tenant, feature, period = key
    return f"key ({tenant[:80]!r}, {feature[:80]!r}, {period[:16]!r})"


def _item_key(key: Key) -> tuple[str, str]:
    """The item's ``(pk, sk)``; a key DynamoDB cannot store raises StoragePermanentError."""
    tenant, feature, period = key
    _check_period(period)
    sk = f"{period}#{feature}"
    if not tenant or len(tenant.encode("utf-8")) > MAX_PK_BYTES:
        raise StoragePermanentError(f"dynamodb: tenant of {_describe(key)} is empty or too long")
    if len(sk.encode("utf-8")) > MAX_SK_BYTES:
        raise StoragePermanentError(f"dynamodb: feature of {_describe(key)} is too long")
    return tenant, sk


def _values_prefix(key: Key) -> tuple[str, str]:
    """The partition and sort-key prefix of ``key``'s value items; a key DynamoDB cannot
    store them under (with a value of the longest kept) raises StoragePermanentError."""
    tenant, feature, period = check_values_key(key)
    prefix = f"{_VALUE_SK}{period}#{feature}{VALUE_MARK}"
    if len(tenant.encode("utf-8")) > MAX_PK_BYTES:
        raise StoragePermanentError(f"dynamodb: tenant of {_describe(key)} is too long")
    if len(prefix.encode("utf-8")) + MAX_VALUE_BYTES > MAX_SK_BYTES:
        raise StoragePermanentError(f"dynamodb: feature of {_describe(key)} is too long")
    return tenant, prefix


def _claimant(item: dict[str, Any], what: str) -> str:
    """The claimant a value item holds."""
    try:
        return str(item["c"]["S"])
    except (KeyError, TypeError) as exc:
        raise StoragePermanentError(f"dynamodb: undecodable value item of {what}") from exc


def _mark(item: dict[str, Any], period: str) -> PeriodMark:
    """A stored period mark item as a mark."""
    try:
        state = str(item["state"]["S"])
        if state not in MARK_STATES:
            raise ValueError(state)
        return PeriodMark(
            str(item["sk"]["S"]),
            state,
            float(item["at"]["N"]),
            str(item["by"]["S"]),
            mark_units_from_text(item["u"]["S"]) if "u" in item else None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise StoragePermanentError(f"dynamodb: undecodable period mark in {period}") from exc


def _reading(item: dict[str, Any]) -> GaugeReading:
    """A gauge's reading from its item."""
    try:
        value = _number(item["t"])
        at_ms = _number(item["ga"])
        node = item["gn"]["S"]
    except (KeyError, TypeError, ValueError) as exc:
        raise StoragePermanentError(f"dynamodb: undecodable gauge item: {exc!r}") from None
    return (value, at_ms, str(node))


def _check_period(period: str) -> None:
    if not periods.is_period(period):  # (cached: a flush or a seeding read asks per key)
        raise StoragePermanentError(f"dynamodb: period {period[:80]!r} is not a period name")


#: Attribute name prefixes of the units a process admitted onto a budget item, and of its
#: last such write's op (one attribute each per process: ADD and SET reach no deeper in an
#: item that the same write may be making).
_ADMITTED_UNITS, _ADMITTED_OP = "u#", "o#"


def _body_tag(body: str) -> str:
    """What a budget item's ``gv`` holds: a digest of its body, so an admit is decided on
    exactly the body it names (an expression value is capped at 4 KB; a body is not)."""
    return hashlib.blake2b(body.encode(), digest_size=16).hexdigest()


def _budget_item(item: dict[str, Any], key: Key) -> BudgetItem:
    """A stored budget item (no ``gv``: written before admits existed, takes none)."""
    try:
        admitted = tuple(
            (
                name[len(_ADMITTED_UNITS) :],
                _number(value),
                str(item.get(_ADMITTED_OP + name[len(_ADMITTED_UNITS) :], {}).get("S", "")),
            )
            for name, value in sorted(item.items())
            if name.startswith(_ADMITTED_UNITS)
        )
        return BudgetItem(_number(item["v"]), item["b"]["S"], admitted, "gv" in item)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise StoragePermanentError(f"dynamodb: undecodable budget item {key!r}") from exc


def _budget_key(key: Key) -> dict[str, Any]:
    return {"pk": {"S": key[0]}, "sk": {"S": f"{_BUDGET_SK}{key[2]}#{key[1]}"}}


def _alert_ttl(retention_days: int) -> int:
    """Epoch seconds at which DynamoDB may expire a claimed alert: after the retention past the
    end of any period it can be of (now plus 32 days covers the current month)."""
    return int(time.time()) + (retention_days + 32) * 86400


def _ttl(period: str, retention_days: int) -> int:
    """Epoch seconds at which DynamoDB may expire the item: the later of the period's end and
    now, plus the retention (a late write to an old period must not expire at once)."""
    end = periods.bounds(period)[1]
    return max(int(end), int(time.time())) + retention_days * 86400


def _number(value: dict[str, str]) -> int:
    """A Number attribute as an exact int (we only ever write integers)."""
    text = value["N"]
    try:
        return int(text)
    except ValueError:
        pass
    try:
        dec = Decimal(text)
    except InvalidOperation:
        raise StoragePermanentError(f"dynamodb: not a number: {text[:40]!r}") from None
    if dec != dec.to_integral_value():
        raise StoragePermanentError(f"dynamodb: not an integer: {text[:40]!r}")
    return int(dec)


def _owner_key(node: str) -> dict[str, Any]:
    if not node or len(node.encode("utf-8")) > 900:
        raise StoragePermanentError(f"dynamodb: node id {node[:64]!r} is empty or too long")
    return {"pk": {"S": OWNER_PK}, "sk": {"S": "owner#" + node}}


def _owner(item: dict[str, Any] | None) -> Owner | None:
    if item is None or "tok" not in item:
        return None
    note = item.get("note")
    return Owner(item["tok"]["S"], _number(item["exp"]) / 1000, "" if note is None else note["S"])


def _scan_states(state: Any, period: str) -> list[Any]:
    """The per-segment scan positions in a cursor: 0 (not started), 1 (done) or the last
    key read, ``{"pk": ..., "sk": ...}``; :class:`BadCursor` for anything else."""
    if isinstance(state, list) and len(state) == 3 and state[:2] == ["d", period]:
        states = state[2]
        if isinstance(states, list) and 1 <= len(states) <= MAX_SEGMENTS:
            ok = all(
                (type(st) is int and st in (0, 1))
                or (
                    isinstance(st, dict)
                    and set(st) == {"pk", "sk"}
                    and all(isinstance(v, str) and v for v in st.values())
                )
                for st in states
            )
            if ok and any(st != 1 for st in states):
                return states
    raise BadCursor(f"cursor is not one handed out for period {period}")


def _export_row(item: dict[str, Any], prefix: str, period: str) -> ExportRow:
    try:
        tenant, sk = item["pk"]["S"], item["sk"]["S"]
        total = _number(item["t"]) if "t" in item else 0
    except (KeyError, TypeError, AttributeError) as exc:
        raise StoragePermanentError(f"dynamodb: undecodable item in {period}: {exc!r}") from exc
    return ExportRow(tenant, sk[len(prefix) :], period, total)


def _snapshot(item: dict[str, Any]) -> Snapshot:
    """Decode an item; raises ``StoragePermanentError`` (or ``KeyError``/``TypeError`` for a
    malformed attribute) if it is not what this module writes."""
    total = _number(item["t"]) if "t" in item else 0
    seqs = {
        name[len(SEQ_PREFIX) :]: _number(value)
        for name, value in item.items()
        if name.startswith(SEQ_PREFIX) and "N" in value
    }
    return Snapshot(total, seqs)
