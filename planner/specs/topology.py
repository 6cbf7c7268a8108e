"""The cluster's network as data: the compact description a cluster YAML gives (`TopologySpec`), and the
per-level figures derived from its topology graph (`Fabric`) that the communication model reads.

A cluster is a graph (`profiles.topology` builds it with networkx from a `TopologySpec`, or reads a
user's GraphML / YAML edge list): GPUs (or TPU chips), NVSwitch / NVLink domains, NICs, and tiers of
switches (leaf or top-of-rack, spine, pod and aggregation switches), every edge with a bandwidth per
direction and a latency. `profiles.topology.derive_fabric` reduces the graph to a few numbers per level
of its hierarchy, so that pricing a collective never walks the graph:

- level 0 is the NVLink domain (or the ICI slice of a TPU torus);
- each level above is a unit of the fabric: the GPUs below one tier of switches (a rack behind one
  top-of-rack switch, a rail-optimised scalable unit behind its rail leaves, a pod behind its spines);
- a unit's **egress** is the max-flow from its GPUs to the switches above it (the min cut between the
  unit and the rest), stated per GPU of the unit: the rate each GPU gets when every GPU of the unit
  sends out at once. An oversubscription of 1:7 above a pod makes the pod's egress 1/7 of its NICs'.

Units of one level are alike (same GPU count, consecutive ranks): the derivation refuses a graph whose
units differ, naming a node. Rates are SI (bytes/s per direction), latencies seconds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from planner.errors import SpecError
from planner.specs.base import MAX_GPUS, Spec

#: Bandwidth bounds (bytes/s) and latency bounds (s) of a fabric level, as hardware.py's tiers.
_BW_RANGE = (1e6, 1e15)
_LATENCY_RANGE = (0.0, 1.0)
#: The largest oversubscription ratio a fabric level may state (downlink over uplink capacity).
MAX_OVERSUBSCRIPTION = 1024.0

TopologyKind = Literal["fat-tree", "torus", "graph"]


def _check_nested(sizes: list[int], what: str) -> None:
    """Units of each level are whole numbers of the level below's: sizes grow, each dividing the next."""
    for a, b in zip(sizes, sizes[1:]):
        if b <= a or b % a:
            raise SpecError(f"{what}: unit_gpus must grow, each a multiple of the one below (got {a} then {b})")


class FabricTier(Spec):
    """One level of a switched fabric above the NVLink domain, as a cluster YAML states it: the units of
    `unit_gpus` GPUs that one tier of switches joins, and how much less capacity leaves a unit than
    enters it."""

    name: str = Field(min_length=1, max_length=64, description="Level name, e.g. rack, leaf, pod, cluster.")
    unit_gpus: int = Field(gt=0, le=MAX_GPUS, description="GPUs in one unit of this level (a multiple of the "
                           "level below's unit, the NVLink domain for the first level).")
    oversubscription: float = Field(1.0, ge=1.0, le=MAX_OVERSUBSCRIPTION, description="Downlink over uplink "
                                    "capacity of one unit (7 for 1:7): the unit's egress is its GPUs' capacity "
                                    "into it divided by this. 1 is full bisection.")
    latency_s: float = Field(0.0, ge=_LATENCY_RANGE[0], le=_LATENCY_RANGE[1], description="Latency a message "
                             "that leaves a unit of this level adds to the scale-out tier's per-hop latency "
                             "(the switch hops above; 0: none beyond the tier's).")
    sharp: bool = Field(False, description="The switches of this level reduce in the network (InfiniBand "
                        "SHARP): an all-reduce crossing it sends each byte once up and once down.")


class TorusSpec(Spec):
    """A TPU slice: chips on a 2-D or 3-D torus of ICI links, several slices joined by the data-centre
    network (DCN). The cluster's `intra_node` tier is one ICI link (bytes/s per direction), its
    `inter_node` tier the DCN bandwidth per chip."""

    shape: list[int] = Field(min_length=2, max_length=3, description="Chips along each torus axis, x first "
                             "(ranks run along x fastest), e.g. [4, 4, 8] for a v5p slice of 128 chips.")
    wraparound: list[bool] = Field(description="Whether each axis closes into a ring (a torus axis) or is an "
                                   "open line; one entry per axis.")
    num_slices: int = Field(1, gt=0, le=MAX_GPUS, description="Slices joined by DCN (MaxText's "
                            "num_slices / dcn_* parallelism).")

    @model_validator(mode="after")
    def _check(self) -> "TorusSpec":
        if any(a < 1 for a in self.shape):
            raise SpecError(f"torus shape {self.shape} must have at least one chip along every axis")
        if len(self.wraparound) != len(self.shape):
            raise SpecError(f"torus wraparound has {len(self.wraparound)} entries for {len(self.shape)} axes: "
                            "give one per axis")
        return self

    @property
    def chips_per_slice(self) -> int:
        out = 1
        for a in self.shape:
            out *= a
        return out


class TopologySpec(Spec):
    """How a cluster's graph is built: a generator (`fat-tree`, `torus`) from these few numbers and the
    cluster's link tiers, or a user's graph file (`graph`)."""

    kind: TopologyKind = Field(description="fat-tree: NVLink domains whose NICs join tiers of switches; "
                               "torus: TPU slices; graph: a GraphML or YAML edge-list file.")
    rails: bool = Field(False, description="fat-tree: rail-optimised, the NIC of local GPU j of every server in "
                        "a first-level unit on leaf switch j (DGX SuperPOD); False: one top-of-rack switch per "
                        "first-level unit.")
    levels: list[FabricTier] = Field(default_factory=list, description="fat-tree: the switched levels above "
                                     "the NVLink domain, innermost first; none: one flat scale-out network of "
                                     "full bisection (the two-tier model).")
    torus: TorusSpec | None = Field(None, description="torus: the slice shape and slice count.")
    graph_file: str | None = Field(None, description="graph: the GraphML (.graphml) or YAML edge-list (.yaml) "
                                   "file, relative to the cluster file or absolute.")
    source: str = Field("", description="Where the fabric's structure is published.")

    @model_validator(mode="after")
    def _check(self) -> "TopologySpec":
        if self.kind == "torus" and self.torus is None:
            raise SpecError("topology kind 'torus' needs a torus: mapping (shape, wraparound, num_slices)")
        if self.kind != "torus" and self.torus is not None:
            raise SpecError(f"topology kind {self.kind!r} takes no torus: mapping (only kind 'torus' does)")
        if self.kind == "graph" and not self.graph_file:
            raise SpecError("topology kind 'graph' needs graph_file (a .graphml or .yaml edge list)")
        if self.kind != "graph" and self.graph_file:
            raise SpecError(f"topology kind {self.kind!r} takes no graph_file (only kind 'graph' does)")
        if self.kind != "fat-tree" and (self.levels or self.rails):
            raise SpecError(f"topology kind {self.kind!r} takes no levels or rails (only kind 'fat-tree' does)")
        _check_nested([t.unit_gpus for t in self.levels], "topology levels")
        return self


class FabricLevel(Spec):
    """One level of the derived fabric (see the module docstring): level 0 the NVLink domain (ICI slice)."""

    name: str = Field(description="Level name: nvlink-domain (or ici-slice), then the fabric's own names.")
    unit_gpus: int = Field(gt=0, le=MAX_GPUS, description="GPUs in one unit of this level.")
    egress_bytes_per_s: float = Field(ge=_BW_RANGE[0], le=_BW_RANGE[1], description="Max-flow out of one unit "
                                      "to the rest of the cluster over its GPU count: bytes/s per GPU and "
                                      "direction when all of the unit's GPUs send out at once (raw link rate; "
                                      "the scale-out tier's efficiency applies on use).")
    latency_s: float = Field(ge=_LATENCY_RANGE[0], le=_LATENCY_RANGE[1], description="Per-hop latency of a "
                             "message that leaves a unit of this level.")
    sharp: bool = Field(False, description="In-network reduction for all-reduces that cross this level.")


class Fabric(Spec):
    """The per-level figures of a cluster's topology graph (`profiles.topology.derive_fabric`)."""

    levels: list[FabricLevel] = Field(min_length=1, description="Innermost first; level 0 the NVLink domain. "
                                      "A unit of each level is a whole number of the level below's.")
    torus: TorusSpec | None = Field(None, description="TPU: the slice torus (level 0 is the slice).")
    nodes: int = Field(0, ge=0, description="Nodes of the graph the figures were derived from.")
    edges: int = Field(0, ge=0, description="Edges of that graph.")
    source: str = Field("", description="One line: which graph the figures come from.")

    @model_validator(mode="after")
    def _check(self) -> "Fabric":
        _check_nested([lv.unit_gpus for lv in self.levels], "fabric levels")
        return self
