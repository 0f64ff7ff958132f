"""A batching HTTP receiver for the delivery benchmark, in a process of its own (so the
benchmark's producer does not share its interpreter lock). Counts events (from the
outbox-event-count header, or by parsing), notes the first and last arrival, and with --track
the arrival time of every event id. GET /stats answers {"count", "first", "last"}; GET
/arrivals answers {id: time}. Usage: receiver.py PORT [--track]"""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, TRACK = int(sys.argv[1]), "--track" in sys.argv
state = {"count": 0, "first": None, "last": None}
arrivals: dict[str, float] = {}
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        now = time.time()
        n = int(self.headers.get("outbox-event-count") or 0)
        events = []
        if TRACK or not n:
            events = json.loads(body)
            events = events if isinstance(events, list) else [events]
            n = len(events)
        with lock:
            state["count"] += n
            state["first"] = state["first"] or now
            state["last"] = now
            for e in events:
                arrivals.setdefault(str(e["id"]), now)
        self.reply(200, b"")

    def do_GET(self):
        with lock:
            body = json.dumps(state if self.path == "/stats" else arrivals).encode()
        self.reply(200, body)

    def do_DELETE(self):
        with lock:
            state.update(count=0, first=None, last=None)
            arrivals.clear()
        self.reply(200, b"")

    def reply(self, status, body):
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", PORT), Handler)
server.daemon_threads = True
print("ready", flush=True)
server.serve_forever()
