"""Public functions written by hand for families whose function is more than a declared call
(Family.public_functions names them): an autograd Function, a reduction, chunking over a
matmul. They sit above the arrays layer, which a family module never imports; `autosoft.<name>`
imports one on first use."""
