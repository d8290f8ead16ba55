#!/usr/bin/env python3
"""Where a replicated volume's writes spent their time during one measurement, from the nodes'
Prometheus metrics scraped before and after it (`make compare-ceph` runs this for every
measurement of a replicated Ferrite volume).

    scripts/write-stages.py --volume VOLUME --primary NAME NAME=BEFORE,AFTER [NAME=BEFORE,AFTER ...]

Each NAME is a node; BEFORE and AFTER are its /metrics text. Prints one JSON object:

    {"primary": NAME,
     "host_write": {"count": N, "mean_us": M, "over_10ms": F},       # the primary's host writes,
                                                                   # receipt to reply
     "storage_write": {NAME: {"count": N, "mean_us": M, "over_10ms": F}, ...},
                                                                   # each node's local log writes
     "ack": {REPLICA: {"count": N, "mean_us": M, "over_10ms": F}, ...},
                                                                   # the primary's wait for each
                                                                   # replica's acknowledgement
     "intent_persist": {NAME: {"count": N, "mean_us": M, "over_10ms": F}, ...}}
                                                                   # each node's persists of the
                                                                   # write intent (those it made)

`over_10ms` is the share of samples above 10 ms (a bucket bound). A histogram missing from a
scrape (a node that had not written yet) counts as empty; one whose count went down (a node
restarted) is left out. Exit status 2 on bad arguments or unreadable files.
"""

import argparse
import json
import re
import sys

SERIES = re.compile(r'^(?P<name>[a-z_]+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$')
LABEL = re.compile(r'(?P<key>[a-z_]+)="(?P<value>(?:[^"\\]|\\.)*)"')
OVER_S = 0.01


def parse(text):
    """-> {(family, frozenset(labels without le)): {"sum": s, "count": n, "le": {bound: count}}}"""
    histograms = {}
    for line in text.splitlines():
        match = SERIES.match(line)
        if not match:
            continue
        name = match["name"]
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix):
                family = name[: -len(suffix)]
                break
        else:
            continue
        labels = {m["key"]: m["value"] for m in LABEL.finditer(match["labels"])}
        le = labels.pop("le", None)
        try:
            value = float(match["value"])
        except ValueError:
            continue
        entry = histograms.setdefault((family, frozenset(labels.items())), {"sum": 0.0, "count": 0, "le": {}})
        if suffix == "_sum":
            entry["sum"] = value
        elif suffix == "_count":
            entry["count"] = int(value)
        elif le is not None:
            entry["le"][le] = int(value)
    return histograms


def find(histograms, family, **wanted):
    """The one histogram of `family` whose labels include `wanted`, or None."""
    found = [entry for (name, labels), entry in histograms.items()
             if name == family and all((key, value) in labels for key, value in wanted.items())]
    return found[0] if len(found) == 1 else None


def labelled(histograms, family, key, **wanted):
    """{label `key`'s value: histogram} of `family`'s histograms whose labels include `wanted`."""
    out = {}
    for (name, labels), entry in histograms.items():
        if name != family or not all((k, v) in labels for k, v in wanted.items()):
            continue
        value = dict(labels).get(key)
        if value is not None:
            out[value] = entry
    return out


def delta(before, after):
    """Count, mean and share over 10 ms of the samples `after` holds beyond `before`."""
    if after is None:
        return None
    before = before or {"sum": 0.0, "count": 0, "le": {}}
    count = after["count"] - before["count"]
    if count < 0:
        return None
    if count == 0:
        return {"count": 0, "mean_us": None, "over_10ms": None}
    total_s = after["sum"] - before["sum"]
    bound = next((le for le in after["le"] if le != "+Inf" and abs(float(le) - OVER_S) < 1e-12), None)
    over = None
    if bound is not None:
        within = after["le"][bound] - before["le"].get(bound, 0)
        over = round(1 - within / count, 4)
    return {"count": count, "mean_us": round(total_s / count * 1e6, 1), "over_10ms": over}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--volume", required=True)
    parser.add_argument("--primary", required=True)
    parser.add_argument("nodes", nargs="+", metavar="NAME=BEFORE,AFTER")
    args = parser.parse_args()
    scrapes = {}
    for item in args.nodes:
        name, _, files = item.partition("=")
        before_path, _, after_path = files.partition(",")
        if not name or not before_path or not after_path:
            parser.error(f"expected NAME=BEFORE,AFTER, not {item!r}")
        try:
            with open(before_path) as before, open(after_path) as after:
                scrapes[name] = (parse(before.read()), parse(after.read()))
        except OSError as error:
            print(f"write-stages: {error}", file=sys.stderr)
            return 2
    if args.primary not in scrapes:
        parser.error(f"the primary {args.primary!r} is not among the nodes")
    volume = args.volume
    before, after = scrapes[args.primary]
    host = delta(find(before, "ferrite_volume_latency_seconds", volume=volume, op="write"),
                 find(after, "ferrite_volume_latency_seconds", volume=volume, op="write"))
    storage = {}
    for name, (node_before, node_after) in sorted(scrapes.items()):
        stage = delta(find(node_before, "ferrite_replication_storage_write_seconds", volume=volume),
                      find(node_after, "ferrite_replication_storage_write_seconds", volume=volume))
        if stage is not None:
            storage[name] = stage
    acks_before = labelled(before, "ferrite_replication_ack_seconds", "replica", volume=volume)
    acks_after = labelled(after, "ferrite_replication_ack_seconds", "replica", volume=volume)
    acks = {}
    for replica, histogram in sorted(acks_after.items()):
        stage = delta(acks_before.get(replica), histogram)
        if stage is not None:
            acks[replica] = stage
    intents = {}
    for name, (node_before, node_after) in sorted(scrapes.items()):
        stage = delta(find(node_before, "ferrite_replication_intent_persist_seconds", volume=volume),
                      find(node_after, "ferrite_replication_intent_persist_seconds", volume=volume))
        if stage is not None and stage["count"] > 0:
            intents[name] = stage
    json.dump({"primary": args.primary, "host_write": host, "storage_write": storage, "ack": acks,
               "intent_persist": intents}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
