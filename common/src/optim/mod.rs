//! Optimizers whose state can be saved. (Owned by the optim helper.)
