"""The prometheus fixture runs a real Prometheus that scrapes what the test serves."""

from __future__ import annotations

import http.server
import threading

import pytest

from harness.prometheus import static_job


class TinyExporter:
    """An HTTP /metrics endpoint on loopback whose gauge value the test sets."""

    def __init__(self):
        self.value = 42.5
        exporter = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                body = (
                    "# HELP shapeshift_test_value A value set by the test.\n"
                    "# TYPE shapeshift_test_value gauge\n"
                    f'shapeshift_test_value{{source="tiny"}} {exporter.value}\n'
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def exporter():
    tiny = TinyExporter()
    yield tiny
    tiny.close()


def test_prometheus_scrapes_a_local_exporter_and_answers_queries(prometheus, exporter):
    server = prometheus([static_job("tiny", exporter.address)])
    query = 'shapeshift_test_value{job="tiny", source="tiny"}'

    assert server.wait_for(query, lambda value: value == 42.5) == 42.5
    (target,) = server.targets()
    assert (target["health"], target["labels"]["instance"]) == ("up", exporter.address)

    # A new value shows up on a later scrape: the answer comes from live scraping.
    exporter.value = 7
    assert server.wait_for(query, lambda value: value == 7) == 7
