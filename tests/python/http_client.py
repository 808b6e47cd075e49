"""An outside client of examples/http_payments.rs (`--serve`), in Python with
`requests`: concurrent retries with one key charge once, a mismatched retry
is 422, a later retry is the first answer replayed. Prints `python proof ok`.
Usage: python http_client.py http://127.0.0.1:PORT KEY"""
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import requests

base, key = sys.argv[1], sys.argv[2]
headers = {"Idempotency-Key": '"%s"' % key, "X-Tenant": "py", "Content-Type": "application/json"}
payment = json.dumps({"order_id": "P-1", "amount": 1234})


def pay(body=payment):
    return requests.post(base + "/payments", data=body, headers=headers, timeout=30)


with ThreadPoolExecutor(max_workers=10) as pool:
    answers = list(pool.map(lambda _: pay(), range(10)))
statuses = sorted(a.status_code for a in answers)
assert set(statuses) <= {201, 409}, statuses
first = [a for a in answers if a.status_code == 201 and "Idempotent-Replayed" not in a.headers]
assert len(first) == 1, statuses
for a in answers:
    if a.status_code == 409:
        assert a.headers["Content-Type"] == "application/problem+json", a.headers
        assert a.headers["Retry-After"] == "1", a.headers

mismatched = pay(json.dumps({"order_id": "P-1", "amount": 9999}))
assert mismatched.status_code == 422, mismatched.status_code
assert mismatched.json()["type"] == "urn:idempotent:key-reused", mismatched.text

replay = pay()
assert replay.status_code == 201, replay.status_code
assert replay.headers["Idempotent-Replayed"] == "true", replay.headers
assert replay.content == first[0].content, (replay.content, first[0].content)

charged = requests.get(base + "/payments/P-1", headers={"X-Tenant": "py"}, timeout=30).json()
assert charged["charges"] == 1, charged
print("python proof ok: %s; charged %d" % (statuses, charged["charges"]))
