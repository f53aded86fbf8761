package api

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/hitrate"
	"github.com/kvrouter/kvrouter/internal/fleetplan"
	"github.com/kvrouter/kvrouter/router"
)

// Fleet changes without losing the cache (issue 29; DESIGN.md, "Fleet
// plan and worker drains"): what each worker is worth (GET /fleet/plan,
// kvrouter_worker_removal_cost) and draining one (POST /workers/drain,
// /workers/undrain, kvrouter_worker_drained).

// ErrUnknownWorker: a drain of a worker that is not registered (404).
var ErrUnknownWorker = errors.New("unknown worker")

// WorkerDrainer is the optional part of a Replica that drains workers
// through Raft: no new request goes to a drained worker on any replica,
// running ones finish, and the leader deregisters it once idle or past
// its deadline. A Replica without it answers 404 on the drain endpoints.
type WorkerDrainer interface {
	// DrainWorker drains id (a zero deadline: none) and returns once this
	// replica applied it.
	DrainWorker(ctx context.Context, id string, deadline time.Time) error
	// UndrainWorker reverses a drain that has not completed.
	UndrainWorker(ctx context.Context, id string) error
}

// FleetReader is the optional part of a Replica that lists its workers'
// cache in the replicated index and their drains (GET /fleet/plan). A
// Replica without it answers 404 there.
type FleetReader interface {
	FleetWorkers() []FleetWorker
}

// FleetWorker is one registered worker as the fleet plan reads it.
type FleetWorker struct {
	ID        string
	Model     string
	Ranks     []router.WorkerID // its router workers (one per data-parallel rank)
	BlockSize int
	// TotalBlocks is its registered KV capacity over every rank (0: not
	// registered).
	TotalBlocks int
	// HeldBlocks and UniqueBlocks sum its ranks' counts in the index:
	// blocks held, and blocks no other router worker holds (fleet-wide).
	HeldBlocks, UniqueBlocks int
	ActiveRequests           int
	Drained                  bool
	DrainDeadline            time.Time // zero: none
}

// maxDeletionCost is pod-deletion-cost's range (an int32).
const maxDeletionCost = math.MaxInt32

// PlanWorker is one worker's expected loss if it left now.
type PlanWorker struct {
	Worker string `json:"worker"`
	Model  string `json:"model"`
	// RemovalCost is the expected cached tokens lost over the horizon
	// (recompute tokens/s × horizon) plus coldWeight × its unique cached
	// tokens; the plan ranks by it, cheapest first.
	RemovalCost float64 `json:"removal_cost"`
	// PodDeletionCost is RemovalCost as controller.kubernetes.io/pod-deletion-cost
	// wants it: an integer, higher = keep.
	PodDeletionCost int `json:"pod_deletion_cost"`
	// RecomputeTokensPerS is the prefill the fleet would take on per
	// second: the cached tokens served recently from this worker, times
	// the share of its blocks no other worker holds.
	RecomputeTokensPerS float64 `json:"recompute_tokens_per_s"`
	// HitRateLoss is RecomputeTokensPerS over the model's prompt tokens
	// per second: the fleet hit rate (a fraction) it would lose; null
	// without traffic in the window.
	HitRateLoss *float64 `json:"hit_rate_loss"`
	// CachedTokensPerS is the cached tokens the router placed on it per
	// second within the window (hit rates' captured, this replica's
	// traffic).
	CachedTokensPerS float64 `json:"cached_tokens_per_s"`
	HeldBlocks       int     `json:"held_blocks"`
	UniqueBlocks     int     `json:"unique_blocks"`
	// CachedTokenShare and UniqueTokenShare are its part of its model's
	// cached tokens (held), and of the tokens only one worker holds.
	CachedTokenShare *float64 `json:"cached_token_share"`
	UniqueTokenShare *float64 `json:"unique_token_share"`
	ActiveRequests   int      `json:"active_requests"`
	Drained          bool     `json:"drained"`
	DrainDeadline    string   `json:"drain_deadline,omitempty"`
	Reason           string   `json:"reason"`
}

// FleetPlan is GET /fleet/plan's answer.
type FleetPlan struct {
	Window      string       `json:"window"`
	HorizonSecs float64      `json:"horizon_secs"`
	Workers     []PlanWorker `json:"workers"` // cheapest to remove first, then by id
	// Scaling is each model's scale-up and scale-down advice (scaling.go).
	Scaling []ScaleAdvice `json:"scaling"`
	Note    string        `json:"note"`
}

const planNote = "Cost = cached tokens a removal would turn into prefill over the horizon (recent hits on the worker, " +
	"times the share of its blocks no other worker holds) + 0.1 per unique cached token. Hits are this replica's traffic " +
	"in the window; the index is replicated, so every replica ranks alike when the load balancer spreads clients evenly."

// buildPlan ranks ws by removal cost. rep is the hit rates (nil: none
// tracked), window the one to read them over.
func buildPlan(ws []FleetWorker, rep *hitrate.Report, window hitrate.Window) FleetPlan {
	plan := FleetPlan{Window: window.Name, HorizonSecs: fleetplan.Horizon.Seconds(), Workers: []PlanWorker{}, Scaling: []ScaleAdvice{}, Note: planNote}
	secs := window.Span.Seconds()
	captured := map[string]float64{} // rank id → cached tokens in the window
	prompt := map[string]float64{}   // model → prompt tokens in the window
	if rep != nil && secs > 0 {
		for _, m := range rep.Models {
			for _, r := range m.Windows {
				if r.Window == window.Name {
					prompt[m.Model] = float64(r.PromptTokens)
				}
			}
			for _, w := range m.Workers {
				for _, r := range w.Windows {
					if r.Window == window.Name && r.Captured != nil {
						captured[w.Worker] += *r.Captured * float64(r.PromptTokens)
					}
				}
			}
		}
	}
	heldTok, uniqueTok := map[string]float64{}, map[string]float64{}
	for _, w := range ws {
		heldTok[w.Model] += float64(w.HeldBlocks * w.BlockSize)
		uniqueTok[w.Model] += float64(w.UniqueBlocks * w.BlockSize)
	}
	share := func(n, d float64) *float64 {
		if d <= 0 {
			return nil
		}
		v := n / d
		return &v
	}
	for _, w := range ws {
		p := PlanWorker{Worker: w.ID, Model: w.Model, HeldBlocks: w.HeldBlocks, UniqueBlocks: w.UniqueBlocks,
			ActiveRequests: w.ActiveRequests, Drained: w.Drained,
			CachedTokenShare: share(float64(w.HeldBlocks*w.BlockSize), heldTok[w.Model]),
			UniqueTokenShare: share(float64(w.UniqueBlocks*w.BlockSize), uniqueTok[w.Model])}
		if !w.DrainDeadline.IsZero() {
			p.DrainDeadline = w.DrainDeadline.UTC().Format(time.RFC3339Nano)
		}
		var hits float64
		for _, k := range w.Ranks {
			hits += captured[string(k)]
		}
		if secs > 0 {
			p.CachedTokensPerS = hits / secs
		}
		c := fleetplan.Of(fleetplan.Worker{ID: w.ID, BlockSize: w.BlockSize, HeldBlocks: w.HeldBlocks,
			UniqueBlocks: w.UniqueBlocks, CachedTokensPerS: p.CachedTokensPerS})
		p.RecomputeTokensPerS, p.RemovalCost = c.RecomputeTokensPerS, c.Removal
		if secs > 0 {
			p.HitRateLoss = share(p.RecomputeTokensPerS, prompt[w.Model]/secs)
		}
		p.PodDeletionCost = int(min(math.Round(p.RemovalCost), maxDeletionCost))
		p.Reason = planReason(w, p, c.UniqueFraction, window.Name)
		plan.Workers = append(plan.Workers, p)
	}
	slices.SortFunc(plan.Workers, func(a, b PlanWorker) int {
		return cmp.Or(cmp.Compare(a.RemovalCost, b.RemovalCost), strings.Compare(a.Worker, b.Worker))
	})
	return plan
}

// planReason says in one sentence why a worker costs what it does.
func planReason(w FleetWorker, p PlanWorker, uniqueFrac float64, window string) string {
	var why string
	switch {
	case w.HeldBlocks == 0:
		why = "holds no cached blocks: nothing to lose"
	case w.UniqueBlocks == 0:
		why = fmt.Sprintf("every one of its %d cached blocks is also held by another worker", w.HeldBlocks)
	case p.RecomputeTokensPerS == 0:
		why = fmt.Sprintf("%d of its %d cached blocks are held nowhere else, but none was hit in the last %s", w.UniqueBlocks, w.HeldBlocks, window)
	default:
		why = fmt.Sprintf("%.0f%% of its %d cached blocks are held nowhere else; recent hits on them ≈ %.0f prompt tokens/s would be recomputed",
			100*uniqueFrac, w.HeldBlocks, p.RecomputeTokensPerS)
	}
	if w.Drained {
		why = "drained (leaving); " + why
	}
	return why
}

// fleetPlan is this replica's plan now, or false without a FleetReader.
func (s *Server) fleetPlan(now time.Time) (FleetPlan, bool) {
	fr, ok := s.rep.(FleetReader)
	if !ok {
		return FleetPlan{}, false
	}
	window := hitrate.Window{Name: "none"}
	var rep *hitrate.Report
	if s.hits != nil {
		ws := s.hits.Windows()
		window = ws[len(ws)-1] // the longest: "recently" without one burst deciding
		r := s.hits.Snapshot(now)
		rep = &r
	}
	plan := buildPlan(fr.FleetWorkers(), rep, window)
	plan.Scaling = s.scaleAdvice(plan.Workers)
	return plan, true
}

// getFleetPlan is GET /fleet/plan (admin): every worker ranked from the
// cheapest to remove to the dearest, with the figures and the reason.
// ?format=pod-deletion-cost prints instead one kubectl command per worker
// setting controller.kubernetes.io/pod-deletion-cost (the worker id taken
// as its pod's name; ?namespace=NS adds -n NS).
func (s *Server) getFleetPlan(c *gin.Context) {
	plan, ok := s.fleetPlan(time.Now())
	if !ok {
		c.JSON(http.StatusNotFound, gin.H{"error": "this replica has no fleet plan"})
		return
	}
	switch c.Query("format") {
	case "", "json":
		c.JSON(http.StatusOK, plan)
	case "pod-deletion-cost":
		ns := c.Query("namespace")
		if ns != "" && !validK8sName(ns) {
			c.JSON(http.StatusBadRequest, gin.H{"error": "namespace must be a Kubernetes name (lowercase letters, digits, '-')"})
			return
		}
		c.Data(http.StatusOK, "text/plain; charset=utf-8", []byte(podDeletionCosts(plan, ns)))
	default:
		c.JSON(http.StatusBadRequest, gin.H{"error": "format must be json or pod-deletion-cost"})
	}
}

// podDeletionCosts is the plan as kubectl annotate commands, cheapest
// first; workers whose id is not a pod name are listed as comments.
func podDeletionCosts(plan FleetPlan, namespace string) string {
	var b strings.Builder
	b.WriteString("# controller.kubernetes.io/pod-deletion-cost from kvrouter's fleet plan (higher = keep); cheapest to remove first\n")
	ns := ""
	if namespace != "" {
		ns = " -n " + namespace
	}
	for _, w := range plan.Workers {
		if !validK8sName(w.Worker) {
			fmt.Fprintf(&b, "# %s: not a pod name; cost %d\n", strconv.Quote(w.Worker), w.PodDeletionCost)
			continue
		}
		fmt.Fprintf(&b, "kubectl annotate pod%s %s --overwrite controller.kubernetes.io/pod-deletion-cost=%d\n", ns, w.Worker, w.PodDeletionCost)
	}
	return b.String()
}

// validK8sName: a DNS-1123 label (pod and namespace names), so nothing a
// registration names can inject into the printed commands.
func validK8sName(s string) bool {
	if s == "" || len(s) > 253 || s[0] == '-' || s[len(s)-1] == '-' {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-' || r == '.') {
			return false
		}
	}
	return true
}

// drainBody is POST /workers/drain's and /workers/undrain's body.
type drainBody struct {
	ID string `json:"id"`
	// DeadlineSecs (drain only): deregister the worker this long from now
	// even if requests still run there; 0 or absent: wait until idle.
	DeadlineSecs float64 `json:"deadline_secs"`
}

// maxDrainDeadline bounds deadline_secs (the FSM's clock bounds refuse
// times more than a day ahead).
const maxDrainDeadline = 24 * time.Hour

// drainWorker is POST /workers/drain {"id", "deadline_secs"} (admin): 202
// once this replica applied the drain (the worker leaves when idle).
func (s *Server) drainWorker(c *gin.Context) { s.setDrain(c, true) }

// undrainWorker is POST /workers/undrain {"id"} (admin): 200 once applied.
func (s *Server) undrainWorker(c *gin.Context) { s.setDrain(c, false) }

func (s *Server) setDrain(c *gin.Context, drain bool) {
	var body drainBody
	if err := c.ShouldBindJSON(&body); err != nil || body.ID == "" || strings.ContainsRune(body.ID, '#') ||
		body.DeadlineSecs < 0 || body.DeadlineSecs > maxDrainDeadline.Seconds() || math.IsNaN(body.DeadlineSecs) ||
		(!drain && body.DeadlineSecs != 0) {
		want := `body must be {"id": worker (no '#'), "deadline_secs": optional seconds up to 86400}`
		if !drain {
			want = `body must be {"id": worker (no '#')}`
		}
		c.JSON(http.StatusBadRequest, gin.H{"error": want})
		return
	}
	d, ok := s.rep.(WorkerDrainer)
	if !ok {
		c.JSON(http.StatusNotFound, gin.H{"error": "this replica cannot drain workers"})
		return
	}
	ctx := c.Request.Context()
	var deadline time.Time
	var err error
	if drain {
		if body.DeadlineSecs > 0 {
			deadline = time.Now().Add(time.Duration(body.DeadlineSecs * float64(time.Second)))
		}
		err = d.DrainWorker(ctx, body.ID, deadline)
	} else {
		err = d.UndrainWorker(ctx, body.ID)
	}
	if err != nil {
		status := statusOf(err)
		if errors.Is(err, ErrUnknownWorker) {
			status = http.StatusNotFound
		}
		c.JSON(status, gin.H{"error": s.redact(err.Error())})
		return
	}
	if !drain {
		c.JSON(http.StatusOK, gin.H{"id": body.ID, "drained": false})
		return
	}
	out := gin.H{"id": body.ID, "drained": true, "deadline": nil,
		"note": "no new requests go there on any replica; it is deregistered once idle (or at the deadline): poll GET /workers"}
	if !deadline.IsZero() {
		out["deadline"] = deadline.UTC().Format(time.RFC3339Nano)
	}
	c.JSON(http.StatusAccepted, out)
}

// addFleetPlan adds the plan to /cluster/status (the status page shows
// each worker's removal cost).
func (s *Server) addFleetPlan(doc any) {
	if m, ok := doc.(map[string]any); ok {
		if plan, ok := s.fleetPlan(time.Now()); ok {
			m["fleet_plan"] = plan
		}
	}
}

// fleetCollector exports the plan and the drains at scrape time:
// cardinality is the registered workers, twice.
type fleetCollector struct{ s *Server }

var (
	descRemovalCost = prometheus.NewDesc("kvrouter_worker_removal_cost",
		"Expected cached tokens lost if the worker left now (GET /fleet/plan): recent hits on blocks only it holds, over the next 5 minutes, plus 0.1 per unique cached token. Lower = cheaper to remove.",
		[]string{"worker"}, nil)
	descDrained = prometheus.NewDesc("kvrouter_worker_drained",
		"1 while the worker is drained (POST /workers/drain): no new requests, deregistered once idle; 0 otherwise.",
		[]string{"worker"}, nil)
)

func (f *fleetCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descRemovalCost
	ch <- descDrained
	for _, d := range scalingDescs {
		ch <- d
	}
}

func (f *fleetCollector) Collect(ch chan<- prometheus.Metric) {
	plan, ok := f.s.fleetPlan(time.Now())
	if !ok {
		return
	}
	for _, w := range plan.Workers {
		ch <- prometheus.MustNewConstMetric(descRemovalCost, prometheus.GaugeValue, w.RemovalCost, w.Worker)
		drained := 0.0
		if w.Drained {
			drained = 1
		}
		ch <- prometheus.MustNewConstMetric(descDrained, prometheus.GaugeValue, drained, w.Worker)
	}
	collectScaling(ch, plan.Scaling)
}

// registerFleet registers the fleet collector when the replica has a
// fleet to plan.
func registerFleet(s *Server) {
	if _, ok := s.rep.(FleetReader); ok {
		s.cfg.Registry.MustRegister(&fleetCollector{s: s})
	}
}
