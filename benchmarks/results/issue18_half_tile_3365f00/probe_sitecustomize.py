# probe only: let variants that ptxas serialises compile, to time them (autosoft rejects them)
import re
import autosoft.compile as _c
_c.REJECTED_PTXAS_WARNINGS = re.compile(r"(?!x)x")
