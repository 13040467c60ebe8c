"""Small traces built through the Python Trace API, shared by tests."""
import memsched


def two_activation_trace():
    """Two forward ops and two backward ops; two activations, each used by one backward op."""
    t = memsched.Trace()
    for name, phase in (("f", "forward"), ("g", "forward"), ("gb", "backward"), ("fb", "backward")):
        t.add_op(name, phase=phase, duration_us=1.0)
    t.add_tensor(100, "float32", "activation", 0, [1, 2], 2)
    t.add_tensor(200, "float32", "activation", 1, [3], 3)
    return t
