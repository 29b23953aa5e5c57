"""init_process_group(config=Config(...)): the object is used, and explicit arguments win."""
import commrt, numpy as np
from commrt.runtime.config import Config, CommConfig
commrt.init_process_group(config=Config(comm=CommConfig(backend="gloo", timeout_s=20)), timeout=15)
assert commrt.get_backend() == "gloo" and commrt.get_config().comm.timeout_s == 15
t = np.ones(3, np.float32); commrt.all_reduce(t); assert t.tolist() == [2.0] * 3
commrt.destroy_process_group(); print("ok")
