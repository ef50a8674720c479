"""The solution's interpreter: runs solution.py, then answers calls by value (posttrain.tasks.codeexec)."""
# ruff: noqa: F821 (encode/decode come from codec.py, exec'd)
import json
import os
import sys

_req, _ret = os.fdopen(int(sys.argv[1]), "r"), os.fdopen(int(sys.argv[2]), "w")
exec(open("codec.py").read())
def _send(m):
    _ret.write(json.dumps(m) + "\n")
    _ret.flush()
_req.readline()  # hello
try:
    _code = compile(open("solution.py").read(), "solution.py", "exec")
except BaseException as e:
    _send({"stage": "parse", "raise": type(e).__name__})
    raise SystemExit(0) from None
_g = {"__name__": "solution"}
try:
    exec(_code, _g)
except BaseException as e:
    _send({"stage": "run", "raise": type(e).__name__})
    raise SystemExit(0) from None
_send({"names": {k: "callable" if callable(v) else encode(v) for k, v in list(_g.items()) if not k.startswith("__")}})
for _line in _req:
    _m = json.loads(_line)
    try:
        _v = _g[_m["call"]](*decode(_m["args"]), **decode(_m["kwargs"]))
        _send({"value": encode(_v)})
    except BaseException as e:
        _send({"raise": type(e).__name__})
