"""Old names keep working: module paths of earlier versions that moved into packages
(:mod:`.moved`: the same module under both names). Settings are never forwarded between
modules: each lives where the code reads it."""
