package replica

import (
	"context"
	"fmt"
	"hash/fnv"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/router"
)

// The sharded block index (issue 19, --raft-groups G > 1).
//
// Group 0 is the control group: today's node and FSM (r.node, r.fsm), which
// keep the node registry, model configuration and thresholds, and the
// worker placement map (fsm.PlaceWorker). Groups 1..G are data groups: each
// a Raft group of its own (log, snapshots, FSM, JetStream stream
// KV_EVENTS_G<g> and its consumer) that owns the workers placed in it —
// their registrations, leases, predictions and KV events. Every replica
// runs every group, so every replica still holds the whole index and
// routes locally: a lookup asks each group's index (disjoint worker sets,
// router.MergedOverlaps).
//
// With G = 1 there are no data groups: the control group owns the workers
// too, exactly as before sharding (the same log, the same stream).

// MaxRaftGroups bounds --raft-groups: each group is a Raft instance with
// its own port, fsync stream and heartbeats on every replica.
const MaxRaftGroups = 16

// dataGroup is one Raft group that owns workers: a data group, or the
// control group itself when the index is not sharded.
type dataGroup struct {
	id   int // 0: the control group (unsharded); 1..G: data groups
	fsm  *fsm.FSM
	node *cluster.Node
	// placed wakes the group's ingest leader when the placement map
	// changed, to bring its stream's subjects up to date.
	placed chan struct{}
}

func newDataGroup(id int, state *fsm.FSM, node *cluster.Node) *dataGroup {
	return &dataGroup{id: id, fsm: state, node: node, placed: make(chan struct{}, 1)}
}

// notePlaced wakes the group's stream keeper (never blocks).
func (g *dataGroup) notePlaced() {
	select {
	case g.placed <- struct{}{}:
	default:
	}
}

// sharded reports whether workers live in data groups.
func (r *replica) sharded() bool { return len(r.groups) > 0 }

// control is the control group as a dataGroup: the owner of every worker
// when the index is not sharded.
func (r *replica) control() *dataGroup { return r.ctl }

// ownerGroups are the groups that hold workers.
func (r *replica) ownerGroups() []*dataGroup {
	if r.sharded() {
		return r.groups
	}
	return []*dataGroup{r.control()}
}

// groupOf is the group that owns worker (its base id, without "#rank"),
// if the worker is placed: the group its placement names, except while it
// moves there (moves.go). Then the group it comes from answers until it
// let go of the worker (deregistered it, adopt's last step, after the
// whole copy committed in the new group): the new group's copy is
// incomplete until then, the old group's is whole and takes no more
// events. So reads — routing among them — see the worker's blocks
// throughout a move. A registration a lost placement race left in another
// group is handed over the same way (adoptMoved).
func (r *replica) groupOf(worker string) (*dataGroup, bool) {
	if !r.sharded() {
		return r.control(), true
	}
	p, ok := r.fsm.Placement(worker)
	if !ok || p < 1 || int(p) > len(r.groups) {
		return nil, false
	}
	g := r.groups[p-1]
	if from := r.registeredElsewhere(worker, g); from != nil {
		return from, true
	}
	return g, true
}

// registrationGroup is the group a registration (or its renewal) of
// worker goes to: the placed group once it registered the worker, else the
// group that still does (a move not adopted yet). Unlike reads (groupOf) it
// moves to the new group at the first step of the hand-over, so a renewal
// cannot re-create the registration the hand-over's last step removes from
// the old group.
func (r *replica) registrationGroup(worker string) (*dataGroup, bool) {
	if !r.sharded() {
		return r.control(), true
	}
	p, ok := r.fsm.Placement(worker)
	if !ok || p < 1 || int(p) > len(r.groups) {
		return nil, false
	}
	g := r.groups[p-1]
	if _, ok := g.fsm.Worker(worker); ok {
		return g, true
	}
	if from := r.registeredElsewhere(worker, g); from != nil {
		return from, true
	}
	return g, true
}

// workers is every registered worker, each from the group that owns it
// (groupOf): the one its placement names or, while it moves there, the
// one it comes from.
func (r *replica) workers() []fsm.WorkerRecord {
	return mergeRanks(r, (*fsm.FSM).Workers, func(w fsm.WorkerRecord) router.WorkerID { return router.WorkerID(w.ID) })
}

// worker is the registration of id in its placed group.
func (r *replica) worker(id string) (fsm.WorkerRecord, bool) {
	g, ok := r.groupOf(id)
	if !ok {
		return fsm.WorkerRecord{}, false
	}
	return g.fsm.Worker(id)
}

// roleWorkers is fsm.RoleWorkers over every owner group.
func (r *replica) roleWorkers(model string) []router.RoleWorker {
	return mergeRanks(r, func(f *fsm.FSM) []router.RoleWorker { return f.RoleWorkers(model) },
		func(w router.RoleWorker) router.WorkerID { return w.ID })
}

// workerInfos is fsm.WorkerInfos over every owner group.
func (r *replica) workerInfos(model string) []router.WorkerInfo {
	return mergeRanks(r, func(f *fsm.FSM) []router.WorkerInfo { return f.WorkerInfos(model) },
		func(w router.WorkerInfo) router.WorkerID { return w.ID })
}

// mergeRanks is a per-rank (or per-worker) list read from every owner
// group, each entry taken only from the group its worker is placed in,
// sorted by id (unsharded: the control group's list as it is).
func mergeRanks[T any](r *replica, read func(*fsm.FSM) []T, id func(T) router.WorkerID) []T {
	if !r.sharded() {
		return read(r.fsm)
	}
	var out []T
	for _, g := range r.groups {
		for _, w := range read(g.fsm) {
			if r.placedIn(id(w), g) {
				out = append(out, w)
			}
		}
	}
	slices.SortFunc(out, func(a, b T) int { return strings.Compare(string(id(a)), string(id(b))) })
	return out
}

// placedIn: the worker of rank id key is placed in g.
func (r *replica) placedIn(key router.WorkerID, g *dataGroup) bool {
	base, _, _ := strings.Cut(string(key), "#")
	at, ok := r.groupOf(base)
	return ok && at == g
}

// overlaps is the overlap source routers read: one index, or every data
// group's, each worker read from the group that owns it (ownerPart: a
// moving worker is registered in two) and kv-pooled's unique counts taken
// fleet-wide.
func (r *replica) overlaps() router.OverlapSource {
	return r.mergedSource((*fsm.FSM).Overlaps, (*fsm.FSM).Index)
}

// predictedOverlaps is overlaps for kv-approx's predictions.
func (r *replica) predictedOverlaps() router.OverlapSource {
	return r.mergedSource((*fsm.FSM).PredictedOverlaps, nil)
}

// mergedSource is read's source of the control group, unsharded, or one
// over every data group's; index, when given, is each group's index for
// the fleet-wide unique counts.
func (r *replica) mergedSource(read func(*fsm.FSM) router.OverlapSource, index func(*fsm.FSM) *router.Index) router.OverlapSource {
	if !r.sharded() {
		return read(r.fsm)
	}
	parts := make([]router.OverlapSource, len(r.groups))
	opt := router.MergeOptions{Owner: r.ownerPart}
	for i, g := range r.groups {
		parts[i] = read(g.fsm)
		if index != nil {
			opt.Indexes = append(opt.Indexes, func() *router.Index { return index(g.fsm) })
		}
	}
	return router.NewMergedOverlaps(parts, opt)
}

// ownerPart is the position in r.groups of the group that answers for the
// worker of rank key (groupOf), -1 when it is not placed.
func (r *replica) ownerPart(key router.WorkerID) int {
	base, _, _ := strings.Cut(string(key), "#")
	g, ok := r.groupOf(base)
	if !ok || g.id < 1 {
		return -1
	}
	return g.id - 1
}

// modelBlockSize is the block size a model's registered workers share (0:
// none registered), from whichever group holds them.
func (r *replica) modelBlockSize(model string) int {
	for _, g := range r.ownerGroups() {
		for _, w := range g.fsm.WorkerInfos(model) {
			if r.placedIn(w.ID, g) {
				return g.fsm.ModelBlockSize(model)
			}
		}
	}
	return 0
}

// fsmModels is fsm.Models over the control group (configured models) and
// every owner group (models with workers).
func (r *replica) fsmModels() []string {
	seen := slices.Clone(r.fsm.Models())
	for _, g := range r.groups {
		seen = append(seen, g.fsm.Models()...)
	}
	slices.Sort(seen)
	return slices.Compact(seen)
}

// indexEpoch is the decision log's index epoch: the control group's applied
// index plus every data group's. It grows with every entry any group
// applies, so two decisions with equal epochs read the same replicated
// state (on one replica); unsharded it is the applied index, as before.
func (r *replica) indexEpoch() uint64 {
	e := r.fsm.AppliedIndex()
	for _, g := range r.groups {
		e += g.fsm.AppliedIndex()
	}
	return e
}

// placeWorker returns the group that owns worker, placing it first when it
// is new: the data group with the fewest placed workers, ties broken by a
// hash of the id, so replicas registering the same worker at once almost
// always pick the same group. If they do not, the later placement wins and
// the loser's registration is invisible (workers) and expires.
func (r *replica) placeWorker(ctx context.Context, worker string) (*dataGroup, error) {
	if g, ok := r.registrationGroup(worker); ok {
		return g, nil
	}
	if behind := r.groupsBehind(); behind != "" {
		return nil, fmt.Errorf("%w: %s", api.ErrUnavailable, behind)
	}
	// Only the groups the cluster has grown to (grow.go): a replica
	// restarted with more runs them before an operator adds them.
	counts := make([]int, len(r.activeGroups()))
	for _, g := range r.fsm.Placements() {
		if g >= 1 && int(g) <= len(counts) {
			counts[g-1]++
		}
	}
	best := chooseGroup(counts, worker)
	cmd, err := fsm.EncodePlaceWorker(fsm.PlaceWorker{Worker: worker, Group: uint32(best + 1), Groups: uint32(r.clusterGroups())})
	if err != nil {
		return nil, fmt.Errorf("place worker %q: %w", worker, err)
	}
	if err := r.proposeOn(ctx, r.control(), cmd); err != nil {
		return nil, fmt.Errorf("place worker %q in group %d: %w", worker, best+1, err)
	}
	r.waitAppliedOn(ctx, r.control())
	g, ok := r.registrationGroup(worker)
	if !ok {
		return nil, fmt.Errorf("place worker %q: placement committed but not applied here yet", worker)
	}
	return g, nil
}

// chooseGroup is the index (0-based) of the group a new worker goes to,
// given how many workers each holds: the fewest, and among those the first
// at or after a hash of the worker's id, so the choice is the same on
// every replica that sees the same counts and spreads equal groups.
func chooseGroup(counts []int, worker string) int {
	h := fnv.New32a()
	h.Write([]byte(worker))
	start := int(h.Sum32() % uint32(len(counts)))
	best := start
	for i := range counts {
		at := (start + i) % len(counts)
		if counts[at] < counts[best] {
			best = at
		}
	}
	return best
}

// proposeWorker proposes cmd (a command about worker) to the group that
// owns the worker, placing it first if needed.
func (r *replica) proposeWorker(ctx context.Context, worker string, cmd []byte) error {
	g, err := r.placeWorker(ctx, worker)
	if err != nil {
		return err
	}
	return r.proposeOn(ctx, g, cmd)
}

// groupAddr is addr with its port moved by offset: a data group's Raft
// address beside the control group's.
func groupAddr(addr string, offset int) (string, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("raft address %q: %w", addr, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p+offset > 65535 || p+offset < 1 {
		return "", fmt.Errorf("raft address %q: port %s + %d is not a port", addr, port, offset)
	}
	return net.JoinHostPort(host, strconv.Itoa(p+offset)), nil
}

// groupClusterConfig is data group g's node configuration: the control
// group's with the Raft port (and every peer's) moved by g × step, its own
// data directory, endpoints under /cluster/g<g> and a group label on its
// metrics. Leaders are found through the control group's node registry
// (the HTTP address is the replica's, whatever the group).
func groupClusterConfig(cfg Config, g int, bundle *pki.Bundle, control, state *fsm.FSM, reg prometheus.Registerer, log *slog.Logger) (cluster.Config, error) {
	c := clusterConfig(cfg, bundle, state, reg, log)
	off := g * cfg.RaftGroupPortStep
	var err error
	if c.RaftAddr, err = groupAddr(c.RaftAddr, off); err != nil {
		return c, err
	}
	if c.AdvertiseAddr != "" {
		if c.AdvertiseAddr, err = groupAddr(c.AdvertiseAddr, off); err != nil {
			return c, err
		}
	}
	peers := make([]cluster.Peer, len(c.Peers))
	for i, p := range c.Peers {
		peers[i] = p
		if peers[i].RaftAddr, err = groupAddr(p.RaftAddr, off); err != nil {
			return c, err
		}
	}
	c.Peers = peers
	c.DataDir = filepath.Join(cfg.DataDir, fmt.Sprintf("raft-g%d", g))
	c.PathPrefix = groupPathPrefix(g)
	c.Group = strconv.Itoa(g)
	c.Logger = log.With("component", "raft") // the node adds "group"
	c.LeaderHTTP = func(id string) string {
		rec, _ := control.Node(id)
		return rec.HTTPAddr
	}
	return c, nil
}

// groupPathPrefix is where data group g's cluster endpoints live.
func groupPathPrefix(g int) string { return "/cluster/g" + strconv.Itoa(g) }

// openGroups builds the data groups (none when cfg.RaftGroups <= 1).
func openGroups(cfg Config, bundle *pki.Bundle, control *fsm.FSM, reg prometheus.Registerer, log *slog.Logger) ([]*dataGroup, error) {
	var out []*dataGroup
	for g := 1; cfg.RaftGroups > 1 && g <= cfg.RaftGroups; g++ {
		state, err := fsm.NewFSM(cfg.Router)
		if err != nil {
			return out, fmt.Errorf("state machine of group %d: %w", g, err)
		}
		state.SetDigestCheckpoints(cfg.DigestCheckpointEvery)
		cc, err := groupClusterConfig(cfg, g, bundle, control, state, reg, log)
		if err != nil {
			return out, fmt.Errorf("raft group %d: %w", g, err)
		}
		node, err := cluster.New(cc, state)
		if err != nil {
			return out, fmt.Errorf("raft node of group %d: %w", g, err)
		}
		out = append(out, newDataGroup(g, state, node))
	}
	return out, nil
}

// formGroups forms every data group, side by side (each waits for its
// peers like the control group's Form).
func formGroups(ctx context.Context, groups []*dataGroup) error {
	errs := make([]error, len(groups))
	var wg sync.WaitGroup
	for i, g := range groups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := g.node.Form(ctx); err != nil {
				errs[i] = fmt.Errorf("group %d: %w", g.id, err)
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// streamWorkers are the workers whose events group g's stream takes: placed
// in g, registered in g and in no other group. A worker placed in g but
// still registered elsewhere is being moved (adopt runs first); one placed
// but not registered yet has no registry entry to validate its events
// against (they would be refused as unknown and lost): its publisher waits
// instead, re-sending, until its subject is captured.
func (r *replica) streamWorkers(g *dataGroup) []string {
	var out []string
	for _, w := range r.placedWorkers(g.id) {
		if _, ok := g.fsm.Worker(w); !ok {
			continue
		}
		if r.registeredElsewhere(w, g) == nil {
			out = append(out, w)
		}
	}
	return out
}

// registeredElsewhere is a group other than g that registers worker, if any.
func (r *replica) registeredElsewhere(worker string, g *dataGroup) *dataGroup {
	for _, o := range r.groups {
		if o == g {
			continue
		}
		if _, ok := o.fsm.Worker(worker); ok {
			return o
		}
	}
	return nil
}

// placedWorkers are the workers the placement map puts in group g, sorted.
func (r *replica) placedWorkers(g int) []string {
	var out []string
	for w, at := range r.fsm.Placements() {
		if int(at) == g {
			out = append(out, w)
		}
	}
	slices.Sort(out)
	return out
}

// checkFleetBlockSize refuses a registration whose block size differs from
// its model's workers in other groups: each group's FSM checks only its
// own workers (fsm's one-block-size-per-model rule), so across groups the
// replica checks before proposing. Unsharded this is the FSM's check alone.
func (r *replica) checkFleetBlockSize(c fsm.RegisterWorker, g *dataGroup) error {
	want := c.BlockSize
	if want == 0 {
		want = r.cfg.Router.BlockSize
	}
	for _, o := range r.groups {
		if o == g {
			continue
		}
		for _, w := range o.fsm.WorkerInfos(c.Model) {
			if !r.placedIn(w.ID, o) {
				continue
			}
			if bs := o.fsm.ModelBlockSize(c.Model); bs != want {
				return fmt.Errorf("worker %q: block size %d, model %q has %d (its workers in group %d): %w", c.ID, want, c.Model, bs, o.id, router.ErrBlockSizeMismatch)
			}
			break
		}
	}
	return nil
}

// indexBlocks is the number of blocks in every owner group's index.
func (r *replica) indexBlocks() int {
	n := 0
	for _, g := range r.ownerGroups() {
		n += g.fsm.Index().Len()
	}
	return n
}

// heldBlocks is how many blocks rank key of worker holds in its group's index.
func (r *replica) heldBlocks(worker string, key router.WorkerID) int {
	g, ok := r.groupOf(worker)
	if !ok {
		return 0
	}
	return g.fsm.Index().Held(key)
}

// staleRanks, cursors and overCapacityRefused merge the owner groups' (a
// worker's ranks live in one group; a lost placement race's leftover in
// another is skipped).
func (r *replica) staleRanks() map[fsm.RankKey]fsm.StaleInfo {
	return mergeRankMaps(r, (*fsm.FSM).Stale)
}

func (r *replica) cursors() map[fsm.RankKey]uint64 { return mergeRankMaps(r, (*fsm.FSM).Cursors) }

// mergeRankMaps is a per-rank map read from every owner group, each rank
// taken only from the group its worker is placed in.
func mergeRankMaps[V any](r *replica, read func(*fsm.FSM) map[fsm.RankKey]V) map[fsm.RankKey]V {
	if !r.sharded() {
		return read(r.fsm)
	}
	out := map[fsm.RankKey]V{}
	for _, g := range r.groups {
		for k, v := range read(g.fsm) {
			if at, ok := r.groupOf(k.Worker); ok && at == g {
				out[k] = v
			}
		}
	}
	return out
}

func (r *replica) overCapacityRefused() map[string]uint64 {
	if !r.sharded() {
		return r.fsm.OverCapacityRefused()
	}
	out := map[string]uint64{}
	for _, g := range r.groups {
		for k, v := range g.fsm.OverCapacityRefused() {
			out[k] += v
		}
	}
	return out
}

// groupStatus is /cluster/status's "raft_groups": per data group its Raft
// state, leader, indexes, blocks, workers and (when asked) digest, so an
// operator and the chaos suite compare replicas group by group.
func (r *replica) groupStatus(digest bool) []map[string]any {
	out := make([]map[string]any, 0, len(r.groups))
	for _, g := range r.groups {
		st := g.node.StatusWithoutDigest()
		e := map[string]any{"group": g.id, "raft_addr": st.RaftAddr, "state": st.State, "leader_id": st.LeaderID,
			"term": st.Term, "applied_index": st.AppliedIndex, "commit_index": st.CommitIndex,
			"last_snapshot_index": st.LastSnapshotIndex, "snapshots_restored": st.SnapshotsRestored,
			"ready": st.Ready, "ready_reason": st.ReadyReason, "index_blocks": g.fsm.Index().Len(),
			"workers": len(r.placedWorkers(g.id)), "stream": eventbus.GroupStreamName(g.id)}
		if st.Halted != "" {
			e["halted"] = st.Halted
		}
		if digest {
			e["digest"] = g.fsm.Digest()
		}
		e["digest_checkpoints"] = g.fsm.Checkpoints() // the peers' state agreement compares them
		out = append(out, e)
	}
	return out
}

// proposeToOwner proposes cmd to the group that owns the worker of rank
// key, which must be placed already (predictions: only for workers the
// router routed to, so registered ones).
func (r *replica) proposeToOwner(ctx context.Context, key router.WorkerID, cmd []byte) error {
	base, _, _ := strings.Cut(string(key), "#")
	g, ok := r.groupOf(base)
	if !ok {
		return fmt.Errorf("worker %q: not placed in any group: %w", base, router.ErrUnknownWorker)
	}
	return r.proposeOn(ctx, g, cmd)
}

// preferredLeader is the replica that should lead data group g: the
// voters sorted by id, taken round-robin from g, so with G groups and N
// replicas each leads about G/N of them (and the control group's leader,
// wherever it is, adds one). Empty with no voters.
func preferredLeader(voters []string, g int) string {
	if len(voters) == 0 {
		return ""
	}
	v := slices.Sorted(slices.Values(voters))
	return v[g%len(v)]
}

// spreadLeadership runs on every replica for data group g: whenever this
// replica leads g and another voter is g's preferred leader, it hands
// leadership over. A failed transfer (the preferred replica down or
// behind) backs off up to leaderSpreadMaxBackoff, during which this
// replica keeps leading: spreading is an optimisation, never a reason to
// leave a group leaderless.
func (r *replica) spreadLeadership(ctx context.Context, g *dataGroup) {
	wait := leaderSpreadEvery
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		if !g.node.IsLeader() {
			wait = leaderSpreadEvery
			continue
		}
		want := preferredLeader(g.node.Voters(), g.id)
		if want == "" || want == r.cfg.NodeID {
			wait = leaderSpreadEvery
			continue
		}
		if err := g.node.TransferLeadershipTo(want); err != nil {
			wait = min(2*wait, leaderSpreadMaxBackoff)
			r.log.Info("raft group leadership stays here: the preferred leader did not take it", "group", g.id, "preferred", want, "retry_in", wait, "err", err)
			continue
		}
		r.log.Info("raft group leadership handed to its preferred replica", "group", g.id, "to", want)
		wait = leaderSpreadEvery
	}
}

// clusterHandler serves the control group's /cluster/ endpoints and each
// data group's under /cluster/g<g>/.
func clusterHandler(control *cluster.Node, groups []*dataGroup) http.Handler {
	if len(groups) == 0 {
		return control.Handler()
	}
	mux := http.NewServeMux()
	mux.Handle("/cluster/", control.Handler())
	for _, g := range groups {
		mux.Handle(groupPathPrefix(g.id)+"/", g.node.Handler())
	}
	return mux
}
