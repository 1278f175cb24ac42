"""A real receiving endpoint for Langfuse on 127.0.0.1: it decodes what the SDK actually sends.

`POST /api/public/otel/v1/traces`: OTLP/HTTP, decoded with OpenTelemetry's own proto package
(`ExportTraceServiceRequest`; protobuf, or JSON by content type; gzip when so encoded).
`POST /api/public/scores`: Langfuse's score batch (langfuse 5.x: a JSON list, answered 202
`{"message": "Accepted"}`); `POST /api/public/ingestion`: the older batch ingestion
(`score-create` events). Anything else: `{}`.
"""

from __future__ import annotations

import gzip
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

TRACES_PATH = "/api/public/otel/v1/traces"
INGESTION_PATH = "/api/public/ingestion"
SCORES_PATH = "/api/public/scores"


@dataclass(frozen=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


@dataclass
class Receiver:
    """What arrived: spans, score bodies, and every request's path and auth header."""

    spans: list[Span] = field(default_factory=list)
    scores: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_traces(self, body: bytes, content_type: str) -> None:
        request = ExportTraceServiceRequest()
        if "json" in content_type:
            json_format.Parse(body, request)
        else:
            request.ParseFromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    self.spans.append(
                        Span(
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            span.name,
                            span.start_time_unix_nano,
                            span.end_time_unix_nano,
                            {a.key: _value(a.value) for a in span.attributes},
                        )
                    )

    def take_ingestion(self, body: bytes) -> None:
        for event in json.loads(body).get("batch", []):
            if event.get("type") == "score-create":
                self.scores.append(event["body"])


def serve(receiver: Receiver) -> tuple[ThreadingHTTPServer, str]:
    """Start the endpoint on a free port of 127.0.0.1; returns the server and its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            with receiver.lock:
                receiver.requests.append((self.path, self.headers.get("Authorization", "")))
                if self.path == TRACES_PATH:
                    receiver.take_traces(body, self.headers.get("Content-Type", ""))
                elif self.path == INGESTION_PATH:
                    receiver.take_ingestion(body)
                elif self.path == SCORES_PATH:
                    receiver.scores.extend(json.loads(body))
            if self.path == SCORES_PATH:
                self._answer(b'{"message": "Accepted"}', 202)
            elif self.path == INGESTION_PATH:
                self._answer(b'{"successes": [], "errors": []}', 207)
            else:
                self._answer(b"{}")

        def do_GET(self) -> None:  # noqa: N802
            self._answer(b"{}")

        def _answer(self, payload: bytes, status: int = 200) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
