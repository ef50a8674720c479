"""Plain data across the pipe between harness and runner, tagged by exact type (posttrain.tasks.codeexec)."""
class Opaque:
    """A value that is not plain data (an object of the solution's own class, a module, a function): equal to
    nothing, so no test that compares it passes."""
    def __init__(self, name):
        self.name = name
    def __eq__(self, other):
        return False
    def __ne__(self, other):
        return True
    def __hash__(self):
        return id(self)
    def __repr__(self):
        return "<" + self.name + ">"
_SEQ = {list: "l", tuple: "t", set: "S", frozenset: "F"}
_SEQ_OF = {v: k for k, v in _SEQ.items()}
def encode(v, _d=0):
    t = type(v)
    try:
        if _d > 64:
            return {"o": "too deep"}
        if v is None:
            return None
        if t is bool:
            return {"b": v}
        if t is int:
            return {"i": str(v)}
        if t is float:
            return {"f": repr(v)}
        if t is str:
            return {"s": v}
        if t in _SEQ:
            return {_SEQ[t]: [encode(x, _d + 1) for x in v]}
        if t is dict:
            return {"d": [[encode(k, _d + 1), encode(x, _d + 1)] for k, x in v.items()]}
        if t is bytes:
            return {"y": v.hex()}
        if t is complex:
            return {"c": [repr(v.real), repr(v.imag)]}
    except Exception:
        return {"o": "unencodable " + t.__name__}
    return {"o": t.__name__}
def decode(v, _d=0):
    if v is None:
        return None
    try:
        (k, x), = v.items()
        if _d > 64:
            return Opaque("too deep")
        if k == "b" and type(x) is bool:
            return x
        if k == "i" and type(x) is str and len(x) <= 5000:
            return int(x)
        if k == "f" and type(x) is str:
            return float(x)
        if k == "s" and type(x) is str:
            return x
        if k in _SEQ_OF and type(x) is list:
            return _SEQ_OF[k](decode(e, _d + 1) for e in x)
        if k == "d" and type(x) is list:
            return {decode(a, _d + 1): decode(b, _d + 1) for a, b in x}
        if k == "y" and type(x) is str:
            return bytes.fromhex(x)
        if k == "c" and type(x) is list:
            return complex(float(x[0]), float(x[1]))
        if k == "o":
            return Opaque(str(x)[:40])
    except Exception:
        pass
    return Opaque("malformed")
