"""Old names keep working: module-level settings read and set through a module other than
the one whose code reads them (:mod:`.forwarding`), and module paths of earlier versions
that moved into packages (:mod:`.moved`)."""
