"""Every malformed request gets a 4xx JSON error naming its field, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from gouache.config import ServerConfig
from tests.api.corpus import GENERATIONS, MALFORMED_REQUESTS, Malformed, malformed_requests
from tests.api.fake_engine import FAKE_INFO

pytestmark = pytest.mark.anyio

# The `config` fixture's limits; the corpus must be built with the same ones.
CASES = malformed_requests(ServerConfig(max_body_bytes=1 << 20, file_ttl_s=60.0), size_step=FAKE_INFO.size_step)


def test_corpus_is_large_and_uniquely_named():
    assert len(MALFORMED_REQUESTS) >= 30
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
async def test_malformed_request_is_rejected(client: httpx.AsyncClient, config: ServerConfig, case: Malformed):
    assert config.max_body_bytes == 1 << 20
    response = await client.request(case.method, case.path, **case.request_kwargs())
    assert response.status_code == case.status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if case.param is not None:
        assert error["param"] == case.param, error
        if case.method == "POST":  # body fields are named in the message too
            assert case.param in error["message"]
    valid = await client.post(GENERATIONS, json={"prompt": "still serving"})
    assert valid.status_code == 200, valid.text
