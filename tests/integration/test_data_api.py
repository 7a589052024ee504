"""The data API answers bad input with a clear 4xx and keeps serving; the token guards every data request."""

from __future__ import annotations

import io
import json

from replicator.coordinator.local_cluster import LocalCluster


async def _raw(cluster: LocalCluster, method: str, path: str, body: str | None, token: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    url = cluster["a"].data_url + path
    data = io.BytesIO(body.encode()) if body is not None else None  # aiohttp warns about large raw bodies
    async with cluster.http.request(method, url, data=data, headers=headers, ssl=cluster.data_ssl) as response:
        return response.status, await response.json(content_type=None)


async def test_bad_requests_are_refused_with_a_reason(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a"], workers=1, token="s3cret")
    cluster["a"].extra["data"] = {"max_value_bytes": 4 * 1024 * 1024}  # the 5 MB value below is over it
    cluster.start()
    try:
        await cluster.wait_ready()
        ok = json.dumps({"v": 1})
        cases = [
            ("PUT", "/data/db/t/x", ok, None, 401, "bearer token"),
            ("PUT", "/data/db/t/x", ok, "wrong", 401, "bearer token"),
            ("PUT", "/data/bad.name/t/x", ok, "s3cret", 400, "bad database name"),
            ("PUT", "/data/db/" + "t" * 65 + "/x", ok, "s3cret", 400, "bad table name"),
            ("PUT", "/data/db/t/x", "{not json", "s3cret", 400, "not valid JSON"),
            ("POST", "/data/db/t", json.dumps({"id": "x"}), "s3cret", 400, "JSON array"),
            ("POST", "/data/db/t", json.dumps([{"id": 5, "value": 1}]), "s3cret", 400, "item 0"),
            ("GET", "/data/nosuchdb/t/x", None, "s3cret", 404, "unknown database 'nosuchdb'"),
            ("GET", "/data/db/t?limit=0", None, "s3cret", 400, "limit"),
            ("PUT", "/data/system/nodes/x", ok, "s3cret", 403, "admin API"),
            ("PUT", "/data/db/t/big", json.dumps("x" * 5_000_000), "s3cret", 413, "exceeds the limit"),
        ]
        for method, path, body, token, status, reason in cases:
            got, answer = await _raw(cluster, method, path, body, token)
            assert (got, reason in answer.get("error", "")) == (status, True), (method, path, got, answer)
        # Nothing bad got in, and the node still serves good requests.
        assert (await _raw(cluster, "GET", "/data/db/t/x", None, "s3cret"))[0] == 404
        assert (await _raw(cluster, "PUT", "/data/db/t/x", ok, "s3cret"))[0] == 200
        status, record = await _raw(cluster, "GET", "/data/db/t/x", None, "s3cret")
        assert status == 200 and record["value"] == {"v": 1} and record["origin"] == "a"
        assert (await _raw(cluster, "DELETE", "/data/db/t/x", None, "s3cret"))[0] == 200
        assert (await _raw(cluster, "DELETE", "/data/db/t/x", None, "s3cret"))[0] == 404
    finally:
        await cluster.close()
