package main

import (
	"cmp"
	"flag"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
	"github.com/kvrouter/kvrouter/internal/warmup"
)

// fleetOptions are sim's fleet-event flags (issue 29 item 5).
type fleetOptions struct {
	removeAt, addAt string
	Remove, Add     []time.Duration
	Chooser         string // --remove-chooser
	Mode            string // --remove-mode: remove, drain
	Window          time.Duration
	Horizon         time.Duration
	Tolerance       float64
	TTFTFactor      float64
	// WarmUpShare is --warmup-share (0: off).
	WarmUpShare float64
	// WarmUpShadow is --warmup-shadow; ShadowInflight --shadow-inflight.
	WarmUpShadow     bool
	ShadowInflight   int
	ShadowMinHolders int
	ShadowEager      bool
	// WarmUpFreshShare is --warmup-fresh-share (with --warmup-shadow).
	WarmUpFreshShare float64
}

// Limits of --remove-worker-at and --add-worker-at.
const (
	maxFleetEvents = 64
	maxEventTime   = 1000 * time.Hour
)

func (o *fleetOptions) register(fs *flag.FlagSet) {
	fs.StringVar(&o.removeAt, "remove-worker-at", "", "fleet events: remove a worker at these virtual times (comma list of durations, e.g. 30s,2m), chosen by --remove-chooser; the run is also simulated without the events, and each event's dip reported against it")
	fs.StringVar(&o.addAt, "add-worker-at", "", "fleet events: add a cold worker (the first worker's --kv-blocks) at these virtual times (comma list of durations)")
	fs.StringVar(&o.Chooser, "remove-chooser", string(sim.ChooserPlan), "which worker --remove-worker-at takes: plan (the cheapest by removal cost: its unique blocks weighted by their recent hits), random, least-loaded, or id:WORKER (that worker: a sweep over every worker bounds what any choice could save)")
	fs.StringVar(&o.Mode, "remove-mode", string(sim.EventRemove), "remove (at once: its cache gone, its running and queued requests re-sent), drain (no new requests; it finishes what it has and leaves when idle; its bound sessions rebind) or drain-sessions (a drain that keeps serving the sessions bound there until they end) or drain-shadow (a drain whose bound sessions' turns still run there while a shadow prefill of each copies it to the session's new worker, where the session moves once the copy is there)")
	fs.Float64Var(&o.WarmUpShare, "warmup-share", 0, "with --add-worker-at: send this share (0..1] of new and duplicated prefixes to the added worker on purpose while the fleet is under 0.8 of its busy thresholds, until its hit rate reaches the fleet's (internal/warmup, the rule of kvrouter's --router-warmup-share); 0 = off")
	fs.BoolVar(&o.WarmUpShadow, "warmup-shadow", false, "with --add-worker-at: warm the added worker by shadow prefills (prefill-only copies of requests, never seen by clients) of the prefixes it lacks, while the fleet and it are under 0.8 of their busy thresholds, and sends it the requests whose prefix a copy brought there, until its hit rate reaches the fleet's; not with --warmup-share")
	fs.IntVar(&o.ShadowInflight, "shadow-inflight", sim.DefaultShadowInflight, "the most shadow prefills (drain-shadow, --warmup-shadow) running on one worker at once")
	fs.IntVar(&o.ShadowMinHolders, "shadow-min-holders", sim.DefaultShadowMinHolders, "--warmup-shadow copies a request's prefix when at least this many workers hold some of it (1: every prefix held somewhere; 2: only duplicated ones)")
	fs.Float64Var(&o.WarmUpFreshShare, "warmup-fresh-share", 0, "with --warmup-shadow: also send this share (0..1] of new content (requests no other worker holds more of than the added worker: new conversations) to it while it and the fleet are under 0.8 of their busy thresholds, and end the warm-up when its cached share of reusable tokens reaches the others'; 0 = the policy places new content")
	fs.BoolVar(&o.ShadowEager, "shadow-eager", false, "with --remove-mode drain-shadow: copy, at the drain, the latest turn of every session that ran on the worker instead of waiting for each session's next turn (the worker can leave about one turn later; a router must keep each bound session's latest request)")
	fs.DurationVar(&o.Window, "event-window", 10*time.Second, "fleet events: width of the windows the dip is measured in (by send time; the steady state is the window before the event)")
	fs.DurationVar(&o.Horizon, "event-horizon", 5*time.Minute, "fleet events: how long after an event cached tokens lost are counted and windows judged")
	fs.Float64Var(&o.Tolerance, "event-tolerance", 0.02, "fleet events: a window's cached-token ratio this close below the same window without the event counts as recovered (a new worker's this close below the steady state, as warm)")
	fs.Float64Var(&o.TTFTFactor, "event-ttft-factor", 1.2, "fleet events: a window's p99 TTFT up to this multiple of the same window's without the event (or of the steady state's, when higher) counts as recovered")
}

// parseEventTimes parses a comma list of non-negative durations (at most
// maxFleetEvents, each at most maxEventTime); "" is none.
func parseEventTimes(s string) ([]time.Duration, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	parts := strings.Split(s, ",")
	if len(parts) > maxFleetEvents {
		return nil, fmt.Errorf("%d times: at most %d", len(parts), maxFleetEvents)
	}
	out := make([]time.Duration, 0, len(parts))
	for _, p := range parts {
		d, err := time.ParseDuration(strings.TrimSpace(p))
		if err != nil {
			return nil, fmt.Errorf("%q is not a duration such as 30s or 2m", p)
		}
		if d < 0 || d > maxEventTime {
			return nil, fmt.Errorf("%v outside [0, %v]", d, maxEventTime)
		}
		out = append(out, d)
	}
	slices.Sort(out)
	return out, nil
}

func (o *fleetOptions) check(so *simOptions) error {
	var err error
	if o.Remove, err = parseEventTimes(o.removeAt); err != nil {
		return cli.Usagef("--remove-worker-at %q: %v", o.removeAt, err)
	}
	if o.Add, err = parseEventTimes(o.addAt); err != nil {
		return cli.Usagef("--add-worker-at %q: %v", o.addAt, err)
	}
	if !sim.Chooser(o.Chooser).Valid() {
		return cli.Usagef("--remove-chooser %q: want plan, random, least-loaded or id:WORKER", o.Chooser)
	}
	switch sim.EventKind(o.Mode) {
	case sim.EventRemove, sim.EventDrain, sim.EventDrainSessions, sim.EventDrainShadow:
	default:
		return cli.Usagef("--remove-mode %q: want remove, drain, drain-sessions or drain-shadow", o.Mode)
	}
	if o.ShadowInflight < 1 || o.ShadowInflight > 1<<16 {
		return cli.Usagef("--shadow-inflight %d: want 1 to %d", o.ShadowInflight, 1<<16)
	}
	if o.ShadowEager && (len(o.Remove) == 0 || o.Mode != string(sim.EventDrainShadow)) {
		return cli.Usagef("--shadow-eager copies a drain-shadow's sessions at the drain: give --remove-worker-at with --remove-mode drain-shadow")
	}
	if o.WarmUpFreshShare != 0 && (!o.WarmUpShadow || !(o.WarmUpFreshShare > 0 && o.WarmUpFreshShare <= 1)) {
		return cli.Usagef("--warmup-fresh-share %v: want a share in (0,1] with --warmup-shadow", o.WarmUpFreshShare)
	}
	if o.ShadowMinHolders < 1 || o.ShadowMinHolders > 1<<10 {
		return cli.Usagef("--shadow-min-holders %d: want 1 to %d", o.ShadowMinHolders, 1<<10)
	}
	if o.WarmUpShadow && (len(o.Add) == 0 || o.WarmUpShare != 0) {
		return cli.Usagef("--warmup-shadow warms an added worker instead of --warmup-share: give --add-worker-at and no --warmup-share")
	}
	switch {
	case o.Window <= 0:
		return cli.Usagef("--event-window %v: must be positive", o.Window)
	case o.Horizon <= 0:
		return cli.Usagef("--event-horizon %v: must be positive", o.Horizon)
	case math.IsNaN(o.Tolerance) || o.Tolerance < 0 || o.Tolerance > 1:
		return cli.Usagef("--event-tolerance %v: want a ratio in [0, 1]", o.Tolerance)
	case math.IsNaN(o.TTFTFactor) || math.IsInf(o.TTFTFactor, 0) || o.TTFTFactor < 1:
		return cli.Usagef("--event-ttft-factor %v: want a finite factor >= 1", o.TTFTFactor)
	}
	if o.WarmUpShare != 0 {
		switch {
		case len(o.Add) == 0:
			return cli.Usagef("--warmup-share warms an added worker: give --add-worker-at")
		case !(o.WarmUpShare > 0 && o.WarmUpShare <= 1):
			return cli.Usagef("--warmup-share %v: want a share in (0,1]", o.WarmUpShare)
		}
	}
	if len(o.Remove) >= so.Workers && so.Workers > 0 {
		return cli.Usagef("--remove-worker-at removes %d of %d workers: leave at least one", len(o.Remove), so.Workers)
	}
	if len(o.events()) > 0 {
		for _, m := range so.Policies {
			if _, peer := peerPolicies[m]; peer {
				return cli.Usagef("policy %s routes by its own scheduler: fleet events act on our routers", m)
			}
		}
	}
	return nil
}

// events are the fleet events in time order (removals before additions
// at the same instant).
func (o *fleetOptions) events() []sim.FleetEvent {
	var evs []sim.FleetEvent
	for _, t := range o.Remove {
		evs = append(evs, sim.FleetEvent{At: t, Kind: sim.EventKind(o.Mode), Chooser: sim.Chooser(o.Chooser)})
	}
	for _, t := range o.Add {
		evs = append(evs, sim.FleetEvent{At: t, Kind: sim.EventAdd})
	}
	slices.SortStableFunc(evs, func(a, b sim.FleetEvent) int { return cmp.Compare(a.At, b.At) })
	return evs
}

// warmUp is --warmup-share's policy (nil: off).
func (o *fleetOptions) warmUp() *warmup.Policy {
	if o.WarmUpShare == 0 {
		return nil
	}
	return &warmup.Policy{Share: o.WarmUpShare, Headroom: warmup.DefaultHeadroom}
}

// dip is how the events' dips are measured.
func (o *fleetOptions) dip(timeout time.Duration) sim.DipOptions {
	return sim.DipOptions{Window: o.Window, Horizon: o.Horizon, Tolerance: o.Tolerance, TTFTFactor: o.TTFTFactor, Timeout: timeout}
}

// fleetCfg is the report's config.fleet_events (absent without events).
type fleetCfg struct {
	RemoveAtS  []float64 `json:"remove_at_s,omitempty"`
	Chooser    string    `json:"remove_chooser,omitempty"`
	Mode       string    `json:"remove_mode,omitempty"`
	AddAtS     []float64 `json:"add_at_s,omitempty"`
	WindowS    float64   `json:"window_s"`
	HorizonS   float64   `json:"horizon_s"`
	Tolerance  float64   `json:"tolerance"`
	TTFTFactor float64   `json:"ttft_factor"`
	// WarmUpShare is --warmup-share (absent: off).
	WarmUpShare float64 `json:"warmup_share,omitempty"`
	// WarmUpShadow is --warmup-shadow (absent: off); ShadowInflight
	// --shadow-inflight (with drain-shadow or --warmup-shadow).
	WarmUpShadow     bool `json:"warmup_shadow,omitempty"`
	ShadowInflight   int  `json:"shadow_inflight,omitempty"`
	ShadowMinHolders int  `json:"shadow_min_holders,omitempty"`
	ShadowEager      bool `json:"shadow_eager,omitempty"`
	// WarmUpFreshShare is --warmup-fresh-share (absent: 0).
	WarmUpFreshShare float64 `json:"warmup_fresh_share,omitempty"`
}

func (o *fleetOptions) config() *fleetCfg {
	if len(o.Remove)+len(o.Add) == 0 {
		return nil
	}
	c := &fleetCfg{WindowS: o.Window.Seconds(), HorizonS: o.Horizon.Seconds(), Tolerance: o.Tolerance, TTFTFactor: o.TTFTFactor, WarmUpShare: o.WarmUpShare}
	for _, t := range o.Remove {
		c.RemoveAtS = append(c.RemoveAtS, t.Seconds())
	}
	if len(o.Remove) > 0 {
		c.Chooser, c.Mode = o.Chooser, o.Mode
	}
	for _, t := range o.Add {
		c.AddAtS = append(c.AddAtS, t.Seconds())
	}
	c.WarmUpShadow = o.WarmUpShadow
	if o.WarmUpShadow || (len(o.Remove) > 0 && o.Mode == string(sim.EventDrainShadow)) {
		c.ShadowInflight = o.ShadowInflight
	}
	if o.WarmUpShadow {
		c.ShadowMinHolders = o.ShadowMinHolders
	}
	c.ShadowEager = o.ShadowEager
	c.WarmUpFreshShare = o.WarmUpFreshShare
	return c
}
