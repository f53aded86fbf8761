package main

import (
	"flag"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/api/tenant"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/router"
)

// tenantOptions are sim's admission-queue and tenant flags (issue 28
// items 3–4): the routers' queue threshold, the tenants and how their
// counters travel.
type tenantOptions struct {
	QueueThreshold float64 // --queue-threshold (set: the routers queue)
	queue          bool
	QueuePolicy    string // --queue-policy
	Spec           string // --tenants
	Counters       string // --tenant-counters
	SyncInterval   time.Duration
	Burst, Slack   float64
	Headroom       bool
	EnginePriority bool    // --tenant-engine-priority
	LatencyGuard   float64 // --tenant-latency-guard
	Isolation      float64 // --tenant-isolation
	Scheduling     string  // --engine-scheduling
	Prefixes       string  // --tenant-prefixes

	tenants []sim.TenantSpec
}

// maxSimTenants bounds --tenants (every tenant is a line of the report).
const maxSimTenants = 64

func (o *tenantOptions) register(fs *flag.FlagSet) {
	fs.Float64Var(&o.QueueThreshold, "queue-threshold", 0, "the routers' admission queue (kvrouter serve's --router-queue-threshold): a request waits in its router while every worker's active prefill tokens, in that router's view, exceed this fraction of its max batched tokens (absent: no queue, as before)")
	fs.StringVar(&o.QueuePolicy, "queue-policy", "fcfs", "with --queue-threshold: the queue's order within a tenant: fcfs, wspt or lcfs (serve's --router-queue-policy)")
	fs.StringVar(&o.Spec, "tenants", "", "tenants as name:weight[@router],…: with --arrival-rate (independent requests), each tenant sends its weight's share of --requests at its share of the rate, a stream of its own drawn from (--seed, its name), so its requests are the same whatever other tenants run; otherwise each request is a tenant's with probability ∝ its weight; @k sends that tenant's requests through router k only (default: round-robin over every router); needs --queue-threshold")
	fs.StringVar(&o.Counters, "tenant-counters", string(sim.CountersShared), "with --tenants and --routers > 1: shared (each router's virtual token counters reach the others on replica sync, --sync-delay later, every --tenant-sync-interval and at once when a tenant starts waiting: kvrouter) or local (each router counts alone: per-replica flow control)")
	fs.DurationVar(&o.SyncInterval, "tenant-sync-interval", sim.DefaultTenantSyncInterval, "with shared counters: how often a router publishes them (serve's --tenant-sync-interval)")
	fs.Float64Var(&o.Burst, "tenant-fair-burst", 0, "the ledgers' burst in tokens (serve's --tenant-fair-burst; 0: its default, 4096)")
	fs.BoolVar(&o.Headroom, "tenant-headroom", false, "hold a tenant over its share, while other tenants are active, to its share (1/active tenants) of each worker's admission window, keeping the rest free for them (api/tenant Ledger.Window)")
	fs.BoolVar(&o.EnginePriority, "tenant-engine-priority", false, "each request carries to its worker the priority its router's ledger gives its tenant (api/tenant Ledger.EnginePriority: 1 while over its share and another tenant is active, else 0; lower is served first), as kvrouter serve --tenant-engine-priority sets vLLM's priority field; the engines then need a priority --engine-scheduling (default with this flag: priority)")
	fs.Float64Var(&o.LatencyGuard, "tenant-latency-guard", 0, "a factor F ≥ 1 (0: off): a request of a tenant over its share, while another tenant is active, goes only to a worker where its router predicts a fresh request's TTFT and TPOT within F × their values on an idle worker (the SLO rule's prediction, router.Router.LatencyGuard), else it waits in the router's queue; tenants at or under their share are never held. Keeps capacity idle on purpose: less throughput for the over-share tenant, a lower tail for the others (serve's --tenant-latency-guard)")
	fs.Float64Var(&o.Isolation, "tenant-isolation", 0, "a safety factor S ≥ 1 (0: off): while a tenant is over its share, k = ⌈workers × S × the under-share tenants' share of the tokens charged fleet-wide over the last 5 s⌉ workers (at least 1, at most all but one), the first k in rendezvous order of their ids (the same on every router), are reserved for the tenants under their share: an over-share tenant's request goes only to the others (it waits in the router's queue while they are full), an under-share tenant's goes to a reserved worker while one has room, else anywhere (with --tenant-latency-guard: to the worker quickest to its first token, reserved ones first among ties, the guard judging the unreserved workers by TTFT alone), and passes the over-share tenant's queued backlog when it has room and nothing of its own queued (api/tenant Ledger.Isolation, ReservedWorkers; serve's --tenant-isolation)")
	fs.StringVar(&o.Scheduling, "engine-scheduling", "", "the engines' waiting-queue policy: fcfs (vLLM's default), priority (vLLM's --scheduling-policy priority: waiting by (priority, arrival), a KV shortage preempts the largest (priority, arrival)) or priority-preempt (that, plus a full running set preempting for a strictly more urgent waiting request, as vLLM v0 did); default fcfs, priority with --tenant-engine-priority (engine/DESIGN.md)")
	fs.StringVar(&o.Prefixes, "tenant-prefixes", workload.TenantPrefixesShared, "with --tenants and --arrival-rate: the tenants' prompt prefixes: shared (every tenant draws from the one pool of --prefixes prefixes, from --seed) or own (each tenant from a pool of its own, of the same size and shape, drawn from (--seed, its name): no cached block common to two tenants, as tenants of a real fleet mostly do not share prefixes; a tenant's requests are still the same whatever other tenants run)")
	fs.Float64Var(&o.Slack, "tenant-fair-slack", 0, "the ledgers' slack in tokens (serve's --tenant-fair-slack; 0: its default, 512)")
}

// check validates the flags; set names the flags given.
func (o *tenantOptions) check(set map[string]bool, so *simOptions) error {
	o.queue = set["queue-threshold"]
	if o.queue && (math.IsNaN(o.QueueThreshold) || math.IsInf(o.QueueThreshold, 0) || o.QueueThreshold < 0) {
		return cli.Usagef("--queue-threshold %v: want a fraction ≥ 0 of the workers' max batched tokens", o.QueueThreshold)
	}
	switch o.QueuePolicy {
	case "fcfs", "wspt", "lcfs":
	default:
		return cli.Usagef("--queue-policy %q: want fcfs, wspt or lcfs", o.QueuePolicy)
	}
	if set["queue-policy"] && !o.queue {
		return cli.Usagef("--queue-policy orders the routers' queue: give --queue-threshold")
	}
	switch o.Scheduling {
	case "":
		o.Scheduling = engine.SchedulingFCFS
		if o.EnginePriority {
			o.Scheduling = engine.SchedulingPriority
		}
	case engine.SchedulingFCFS:
		if o.EnginePriority {
			return cli.Usagef("--tenant-engine-priority sets a non-zero priority, which an fcfs engine refuses (as vLLM does): give --engine-scheduling priority or priority-preempt")
		}
	case engine.SchedulingPriority, engine.SchedulingPriorityPreempt:
	default:
		return cli.Usagef("--engine-scheduling %q: want fcfs, priority or priority-preempt", o.Scheduling)
	}
	for _, name := range []string{"tenant-counters", "tenant-sync-interval", "tenant-fair-burst", "tenant-fair-slack", "tenant-headroom", "tenant-engine-priority", "tenant-latency-guard", "tenant-isolation", "tenant-prefixes"} {
		if set[name] && o.Spec == "" {
			return cli.Usagef("--%s applies to --tenants", name)
		}
	}
	switch o.Prefixes {
	case workload.TenantPrefixesShared:
	case workload.TenantPrefixesOwn:
		if so.ArrivalRate <= 0 || so.Trace != "" || so.Sessions.Turns > 0 {
			return cli.Usagef("--tenant-prefixes own gives each tenant's stream its own prefixes: it needs --arrival-rate with independent synthetic requests (no --trace, no --session-turns)")
		}
	default:
		return cli.Usagef("--tenant-prefixes %q: want shared or own", o.Prefixes)
	}
	if o.Spec == "" {
		return nil
	}
	if !o.queue {
		return cli.Usagef("--tenants: fairness acts in the routers' admission queue: give --queue-threshold (0 queues whenever every worker has prefill work)")
	}
	for _, m := range so.Policies {
		if _, peer := peerPolicies[m]; peer {
			return cli.Usagef("policy %s routes by its own scheduler: --tenants acts on ours", m)
		}
	}
	switch sim.TenantCounters(o.Counters) {
	case sim.CountersShared, sim.CountersLocal:
	default:
		return cli.Usagef("--tenant-counters %q: want shared or local", o.Counters)
	}
	if o.SyncInterval <= 0 {
		return cli.Usagef("--tenant-sync-interval %v: must be positive", o.SyncInterval)
	}
	if math.IsNaN(o.Burst) || math.IsInf(o.Burst, 0) || o.Burst < 0 || (o.Burst > 0 && o.Burst < 1) {
		return cli.Usagef("--tenant-fair-burst %v: want 0 (the default) or at least 1 token", o.Burst)
	}
	if math.IsNaN(o.Slack) || math.IsInf(o.Slack, 0) || o.Slack < 0 {
		return cli.Usagef("--tenant-fair-slack %v: want a number of tokens ≥ 0", o.Slack)
	}
	if err := router.ValidateLatencyGuard(o.LatencyGuard); err != nil {
		return cli.Usagef("--tenant-latency-guard %v: want 0 (off) or a finite factor of at least 1", o.LatencyGuard)
	}
	if !tenant.ValidateIsolation(o.Isolation) || math.IsNaN(o.Isolation) {
		return cli.Usagef("--tenant-isolation %v: want 0 (off) or a finite safety factor of at least 1", o.Isolation)
	}
	var err error
	o.tenants, err = parseTenants(o.Spec, so.Routers)
	return err
}

// parseTenants reads --tenants: name:weight[@router],…
func parseTenants(spec string, routers int) ([]sim.TenantSpec, error) {
	var out []sim.TenantSpec
	seen := map[string]bool{}
	for _, part := range strings.Split(spec, ",") {
		part = strings.TrimSpace(part)
		name, rest, ok := strings.Cut(part, ":")
		if !ok || name == "" {
			return nil, cli.Usagef("--tenants %q: %q is not name:weight[@router]", spec, part)
		}
		if seen[name] {
			return nil, cli.Usagef("--tenants %q: tenant %q listed twice", spec, name)
		}
		seen[name] = true
		weight, at, pinned := strings.Cut(rest, "@")
		w, err := strconv.ParseFloat(weight, 64)
		if err != nil || !(w > 0) || math.IsInf(w, 0) {
			return nil, cli.Usagef("--tenants %q: tenant %q's weight %q: want a positive number", spec, name, weight)
		}
		t := sim.TenantSpec{Name: name, Weight: w, Router: -1}
		if pinned {
			k, err := strconv.Atoi(at)
			if err != nil || k < 0 || k >= routers {
				return nil, cli.Usagef("--tenants %q: tenant %q's router %q: want 0 to %d (--routers %d)", spec, name, at, routers-1, routers)
			}
			t.Router = k
		}
		out = append(out, t)
	}
	if len(out) > maxSimTenants {
		return nil, cli.Usagef("--tenants: %d tenants, at most %d", len(out), maxSimTenants)
	}
	return out, nil
}

// config is the sim's tenant settings.
func (o *tenantOptions) config() sim.Tenants {
	if o.tenants == nil {
		return sim.Tenants{}
	}
	return sim.Tenants{Specs: o.tenants, Counters: sim.TenantCounters(o.Counters), SyncInterval: o.SyncInterval, Burst: o.Burst, Slack: o.Slack, Headroom: o.Headroom, EnginePriority: o.EnginePriority,
		LatencyGuard: o.LatencyGuard, Isolation: o.Isolation}
}

// tenantsCfg is the report's config.tenants.
type tenantsCfg struct {
	QueueThreshold float64          `json:"queue_threshold"`
	QueuePolicy    string           `json:"queue_policy"`
	Tenants        []sim.TenantSpec `json:"tenants,omitempty"`
	Counters       string           `json:"counters,omitempty"`
	SyncIntervalMs float64          `json:"sync_interval_ms,omitempty"`
	Burst          float64          `json:"burst,omitempty"`
	Slack          float64          `json:"slack,omitempty"`
	Headroom       bool             `json:"headroom,omitempty"`
	EnginePriority bool             `json:"engine_priority,omitempty"`
	LatencyGuard   float64          `json:"latency_guard,omitempty"`
	Isolation      float64          `json:"isolation,omitempty"`
	Prefixes       string           `json:"tenant_prefixes,omitempty"` // "own" only
}

func (o *tenantOptions) reportConfig() *tenantsCfg {
	if !o.queue {
		return nil
	}
	c := &tenantsCfg{QueueThreshold: o.QueueThreshold, QueuePolicy: o.QueuePolicy}
	if o.tenants != nil {
		c.Tenants, c.Counters, c.SyncIntervalMs = o.tenants, o.Counters, float64(o.SyncInterval)/float64(time.Millisecond)
		c.Burst, c.Slack, c.Headroom, c.EnginePriority = o.Burst, o.Slack, o.Headroom, o.EnginePriority
		c.LatencyGuard, c.Isolation = o.LatencyGuard, o.Isolation
		if o.Prefixes == workload.TenantPrefixesOwn {
			c.Prefixes = o.Prefixes
		}
	}
	return c
}
