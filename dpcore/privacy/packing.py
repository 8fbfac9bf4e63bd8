"""One Flower message for several clients (node cohorts, the format strategies and clients both speak): `pack` puts k
per-client contents (or error reasons) into one RecordDict, `unpack` takes them out again, checking everything (the
server reads what a node packed, and a node may be hostile).

Each record is packed once however many clients share it: a round's train content is one object for all of its
clients, so the server's message to a node hosting k sampled clients carries the global model once. The record
`protocol.COHORT_INDEX` holds one JSON string: {client id: {record key: packed name} or {"error": reason}}; the
records are stored as "record.0", "record.1", ... The same format serves both ways: the server's message to a node
and the node's reply.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from dpfl.dpcore.privacy import protocol as keys

PACKED = "record."
ERROR = "error"


class WireError(ValueError):
    """A packed message that cannot be read: what is wrong with it."""


def pack(contents: Mapping[int, RecordDict | str]) -> RecordDict:
    """{client id: its content, or its error reason} -> one RecordDict, each record object once."""
    packed, names, index = RecordDict(), {}, {}
    for client, content in contents.items():
        if isinstance(content, str):
            index[str(int(client))] = {ERROR: content}
            continue
        refs = {}
        for key, record in content.items():
            if id(record) not in names:
                names[id(record)] = f"{PACKED}{len(names)}"
                packed[names[id(record)]] = record
            refs[key] = names[id(record)]
        index[str(int(client))] = refs
    packed[keys.COHORT_INDEX] = ConfigRecord({"index": json.dumps(index)})
    return packed


def is_packed(content: RecordDict) -> bool:
    return keys.COHORT_INDEX in content.config_records


def unpack(packed: RecordDict) -> dict[int, RecordDict | str]:
    """{client id: its content, or its error reason}; WireError names what is malformed."""
    index_record = packed.config_records.get(keys.COHORT_INDEX)
    if index_record is None:
        raise WireError(f"no '{keys.COHORT_INDEX}' record")
    try:
        index = json.loads(index_record["index"])
    except (KeyError, TypeError, ValueError) as err:
        raise WireError(f"the '{keys.COHORT_INDEX}' record holds no JSON index ({type(err).__name__})") from None
    if not isinstance(index, dict):
        raise WireError(f"the index is a {type(index).__name__}, not an object")
    records = {**packed.array_records, **packed.metric_records, **packed.config_records}
    contents: dict[int, RecordDict | str] = {}
    for client, refs in index.items():
        if not client.isdigit() or not 0 <= int(client) < keys.MAX_CLIENT_ID:
            raise WireError(f"client id {client!r} is not an integer in [0, 2^53)")
        if not isinstance(refs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in refs.items()):
            raise WireError(f"client {client}: its entry is not an object of strings")
        if ERROR in refs and len(refs) == 1:
            contents[int(client)] = refs[ERROR][:2000]
            continue
        content = RecordDict()
        for key, name in refs.items():
            if not name.startswith(PACKED) or name not in records:
                raise WireError(f"client {client}: record {key!r} names {name!r}, which is not in the message")
            record = records[name]
            if not isinstance(record, (ArrayRecord, MetricRecord, ConfigRecord)):
                raise WireError(f"client {client}: record {name!r} is a {type(record).__name__}")
            content[key] = record
        contents[int(client)] = content
    return contents
