import time, sys
t=time.time()
import torch, commrt, commrt.train
t1=time.time()
commrt.init_process_group()
t2=time.time()
commrt.destroy_process_group()
print(f"OK import {t1-t:.2f} init {t2-t1:.2f} destroy {time.time()-t2:.2f}", flush=True)
