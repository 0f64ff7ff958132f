"""A local webhook receiver for the demo: prints every event outbox_ext's worker delivers and
whether its Standard Webhooks signature verifies. Usage: webhook_receiver.py PORT SECRET"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

PORT, SECRET = int(sys.argv[1]), sys.argv[2]
verifier = Webhook(SECRET)
printing = threading.Lock()   # requests arrive on several threads: one line at a time


class Hook(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        try:
            verifier.verify(body, {k.lower(): v for k, v in self.headers.items()})
            signed = "signature ok"
        except WebhookVerificationError:
            signed = "BAD SIGNATURE"
        data = json.loads(body)
        with printing:
            for event in data if isinstance(data, list) else [data]:
                print(f"received {event['event_type']:<14} {event['aggregate_type']} {event['aggregate_id']:<3} "
                      f"{json.dumps(event['payload'])}  ({signed}, id {event['id']})", flush=True)
        self.send_response(204)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", PORT), Hook).serve_forever()
