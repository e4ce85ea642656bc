"""An import-linter contract type the built-in ones cannot express: a submodule of an external package
(``torch.distributed``) imported only by some modules of ours. import-linter forbids external
packages as a whole only, so this reads the import lines its graph keeps of every ``torch`` import.
Used by ``make lint`` (``lint-imports``, see pyproject.toml)."""

from __future__ import annotations

from importlinter import Contract, ContractCheck, fields, output


class ExternalSubmoduleContract(Contract):
    """``external`` (e.g. ``torch``) may be imported under one of ``submodules`` (e.g.
    ``torch.distributed``) only by ``allowed`` modules and their descendants."""

    external = fields.StringField()
    submodules = fields.ListField(subfield=fields.StringField())
    allowed = fields.ListField(subfield=fields.ModuleField())

    def check(self, graph, verbose: bool) -> ContractCheck:  # type: ignore[no-untyped-def]
        allowed = tuple(module.name for module in self.allowed)  # type: ignore[attr-defined]
        submodules = tuple(str(name) for name in self.submodules)  # type: ignore[attr-defined]
        external = str(self.external)
        found = []
        for importer in sorted(graph.find_modules_that_directly_import(external)):
            if any(importer == name or importer.startswith(f"{name}.") for name in allowed):
                continue
            for detail in graph.get_import_details(importer=importer, imported=external):
                line = detail["line_contents"]
                if any(f" {name}" in f" {line}" for name in submodules):
                    found.append(f"{importer}:{detail['line_number']}: {line}")
        return ContractCheck(kept=not found, metadata={"found": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for line in check.metadata["found"]:
            output.print_error(line)
