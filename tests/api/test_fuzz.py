"""Schema fuzzing (`gouache bench fuzz`), bounded: a few hundred cases generated from a real
server's OpenAPI schema on every endpoint answer 2xx or 4xx, and the server serves a valid
request after them. The schema describes the bodies the image routes really read."""

import pytest

from gouache.bench.fuzz import fuzz, serves_after, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process, url = start_server("shapes-unet", tmp_path_factory.mktemp("fuzz") / "server.log", 64)
    yield process, url
    process.terminate()
    process.wait(60)


def test_the_schema_describes_the_bodies_the_image_routes_read(server):
    import httpx

    document = httpx.get(f"{server[1]}/openapi.json", timeout=10).json()
    paths = document["paths"]
    generation = paths["/v1/images/generations"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert generation == {"$ref": "#/components/schemas/ImageGenerationRequest"}
    fields = document["components"]["schemas"]["ImageGenerationRequest"]["properties"]
    assert {"prompt", "seed", "loras", "controlnets", "slo_ms", "service_tier", "block_cache"} <= set(fields)
    edit = paths["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert edit["properties"]["image"]["format"] == "binary" and "image" in edit["required"]
    assert {"mask", "template_id", "strength", "loras"} <= set(edit["properties"])
    template = paths["/v1/templates"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert "mask" not in template["properties"] and "n" not in template["properties"]


def test_generated_requests_on_every_endpoint_answer_2xx_or_4xx(server):
    process, url = server
    results = fuzz(url, examples=30, progress=lambda line: None)
    assert {r.operation for r in results} >= {"POST /v1/images/generations", "POST /v1/images/edits",
                                              "POST /v1/templates", "POST /v1/loras", "GET /v1/status",
                                              "DELETE /v1/images/requests/{request_id}", "GET /v1/files/{file_id}"}
    assert sum(r.cases for r in results) >= 200  # a few generated cases repeat
    assert [f for r in results for f in r.failures] == []
    assert sum(r.statuses.get("2xx", 0) for r in results if r.operation.startswith("POST /v1/images")) > 0
    assert process.poll() is None and serves_after(url, 64)
