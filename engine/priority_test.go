package engine

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"
)

// firstTokenOrder runs e until idle and returns the ids in the order of
// their FirstToken outputs, and every output.
func firstTokenOrder(t *testing.T, e *Engine) ([]string, []Output) {
	t.Helper()
	outs := runIdle(t, e)
	var order []string
	for _, o := range outs {
		if o.Kind == FirstToken {
			order = append(order, o.RequestID)
		}
	}
	return order, outs
}

// TestEnginePriorityWaitingOrder: one running slot, four requests submitted
// together. FCFS serves them as they came; the priority policies by
// (priority, arrival): C and D (1, C first), then B (2), then A (5).
func TestEnginePriorityWaitingOrder(t *testing.T) {
	reqs := []Request{
		{ID: "A", Priority: 5}, {ID: "B", Priority: 2}, {ID: "C", Priority: 1}, {ID: "D", Priority: 1},
	}
	tests := []struct {
		policy string
		want   []string
	}{
		{"", []string{"A", "B", "C", "D"}},
		{SchedulingFCFS, []string{"A", "B", "C", "D"}},
		{SchedulingPriority, []string{"C", "D", "B", "A"}},
		{SchedulingPriorityPreempt, []string{"C", "D", "B", "A"}},
	}
	for _, tc := range tests {
		t.Run(tc.policy, func(t *testing.T) {
			e := mustNew(t, "w", Config{BlockSize: 4, CapacityBlocks: 64, MaxRunning: 1, Scheduling: tc.policy})
			for i, r := range reqs {
				r.Tokens, r.OutputTokens = seqTokens(100*i+1, 8), 3
				if tc.policy == "" || tc.policy == SchedulingFCFS {
					r.Priority = 0 // refused under FCFS, as by vLLM
				}
				if err := e.Submit(0, r); err != nil {
					t.Fatal(err)
				}
			}
			got, outs := firstTokenOrder(t, e)
			if !slices.Equal(got, tc.want) {
				t.Errorf("first tokens in order %v, want %v", got, tc.want)
			}
			if _, ok := find(outs, "A", Preempted); ok {
				t.Error("a request was preempted: nothing needed its slot before it finished")
			}
		})
	}
}

// TestEnginePriorityFullRunningSet: A (priority 5) holds the only running
// slot, decoding; B (priority 0) arrives. vLLM v1's priority policy, like
// FCFS, leaves B waiting until A finishes (a full running set stops
// admission); priority-preempt preempts A at the next step, runs B, then
// recomputes A (its prompt and the tokens it had generated).
func TestEnginePriorityFullRunningSet(t *testing.T) {
	for _, policy := range []string{SchedulingFCFS, SchedulingPriority, SchedulingPriorityPreempt} {
		t.Run(policy, func(t *testing.T) {
			e := mustNew(t, "w", Config{BlockSize: 4, CapacityBlocks: 64, MaxRunning: 1, Scheduling: policy})
			pa := 5
			if policy == SchedulingFCFS {
				pa = 0 // refused under FCFS, as by vLLM
			}
			if err := e.Submit(0, Request{ID: "A", Tokens: seqTokens(1, 8), OutputTokens: 10, Priority: pa}); err != nil {
				t.Fatal(err)
			}
			// Run A's prefill and two decode steps.
			var outs []Output
			for range 3 {
				at, ok := e.NextEventTime()
				if !ok {
					t.Fatal("engine idle")
				}
				outs = append(outs, e.Advance(at)...)
			}
			if err := e.Submit(e.Stats().Now, Request{ID: "B", Tokens: seqTokens(500, 8), OutputTokens: 2, Priority: 0}); err != nil {
				t.Fatal(err)
			}
			outs = append(outs, runIdle(t, e)...)
			aDone, _ := find(outs, "A", Finished)
			bFirst, _ := find(outs, "B", FirstToken)
			pre, preempted := find(outs, "A", Preempted)
			st := e.Stats()
			if policy != SchedulingPriorityPreempt {
				if preempted || bFirst.At <= aDone.At {
					t.Errorf("B's first token at %v, A finished at %v, A preempted %v: B must wait for A", bFirst.At, aDone.At, preempted)
				}
				return
			}
			if !preempted || pre.OutputTokens != 3 {
				t.Fatalf("A preempted %v with %d tokens, want after its third token", preempted, pre.OutputTokens)
			}
			if bFirst.At >= aDone.At {
				t.Errorf("B's first token at %v, after A finished at %v", bFirst.At, aDone.At)
			}
			if aDone.OutputTokens != 10 || st.Preemptions != 1 || st.UsedBlocks != 0 || st.Finished != 2 {
				t.Errorf("A's finish %+v, stats %+v", aDone, st)
			}
			// A's recompute: 11 tokens known (8 prompt, 3 generated); its
			// two prompt blocks are still cached (the lookup may take up to
			// 10 tokens), so the 3 generated are recomputed, on top of the
			// first 8 and B's 8.
			if st.PrefillTokens != 8+8+3 {
				t.Errorf("prefill tokens %d, want 19", st.PrefillTokens)
			}
		})
	}
}

// TestEnginePriorityPreemptionVictim: a cache too small for three requests'
// outputs. FCFS preempts the newest (TestEnginePreemptionNewestFirst); the
// priority policies the largest (priority, arrival): here the oldest,
// whose priority value is the largest, although it was scheduled earlier
// in the same step (its work is taken back). It rejoins the waiting queue
// behind the others and finishes last.
func TestEnginePriorityPreemptionVictim(t *testing.T) {
	for _, policy := range []string{SchedulingPriority, SchedulingPriorityPreempt} {
		t.Run(policy, func(t *testing.T) {
			e := mustNew(t, "w", Config{BlockSize: 4, CapacityBlocks: 12, Scheduling: policy})
			prio := []int{9, 0, 0}
			for i := range 3 {
				if err := e.Submit(0, Request{ID: fmt.Sprint(i), Tokens: seqTokens(100*i+1, 12), OutputTokens: 12, Priority: prio[i]}); err != nil {
					t.Fatal(err)
				}
			}
			outs := runIdle(t, e)
			var preempted, finished []string
			for _, o := range outs {
				switch o.Kind {
				case Preempted:
					preempted = append(preempted, o.RequestID)
				case Finished:
					finished = append(finished, o.RequestID)
				}
			}
			if len(preempted) == 0 || preempted[0] != "0" {
				t.Fatalf("preempted %v, want 0 first", preempted)
			}
			if len(finished) != 3 || finished[2] != "0" {
				t.Errorf("finished %v, want 0 last", finished)
			}
			if st := e.Stats(); st.Preemptions != uint64(len(preempted)) || st.UsedBlocks != 0 {
				t.Errorf("stats %+v", st)
			}
		})
	}
}

func TestEngineSchedulingPolicyConfig(t *testing.T) {
	if _, err := New("w", Config{BlockSize: 4, CapacityBlocks: 8, Scheduling: "lifo"}); err == nil {
		t.Error("unknown policy accepted")
	}
	if c := mustNew(t, "w", Config{BlockSize: 4, CapacityBlocks: 8}).Config(); c.Scheduling != SchedulingFCFS {
		t.Errorf("default policy %q", c.Scheduling)
	}
	// vLLM refuses a non-zero priority unless its policy is priority.
	e := mustNew(t, "w", Config{BlockSize: 4, CapacityBlocks: 8})
	if err := e.Submit(0, Request{ID: "a", Tokens: seqTokens(1, 4), Priority: 1}); !errors.Is(err, ErrRequest) {
		t.Errorf("priority 1 under FCFS: %v, want ErrRequest", err)
	}
	if err := e.Submit(0, Request{ID: "b", Tokens: seqTokens(1, 4)}); err != nil {
		t.Errorf("priority 0 under FCFS: %v", err)
	}
}

// TestEnginePriorityVictimScheduledEarlier: the victim of a block shortage
// was already scheduled in the step. Six blocks of 4 tokens. A (priority 9,
// a 6-token prompt) starts alone; B and C (priority 0, 8-token prompts)
// arrive during its prefill and are admitted in the next step, filling the
// cache. In the step after, A (first in the running order) needs no new
// block and is scheduled; B needs one, and the victim is A (largest
// priority), not C (the newest): A's decode is taken back from the step
// (vLLM's req_index -= 1 path), so A samples no token in it, and B and C
// go on. A is recomputed once they finish.
func TestEnginePriorityVictimScheduledEarlier(t *testing.T) {
	e := mustNew(t, "w", Config{BlockSize: 4, CapacityBlocks: 6, Scheduling: SchedulingPriority})
	submit := func(at time.Duration, r Request) {
		t.Helper()
		r.OutputTokens = 4
		if err := e.Submit(at, r); err != nil {
			t.Fatal(err)
		}
	}
	submit(0, Request{ID: "A", Priority: 9, Tokens: seqTokens(1, 6)})
	end, _ := e.NextEventTime() // A's prefill
	submit(end/2, Request{ID: "B", Tokens: seqTokens(100, 8)})
	submit(end/2, Request{ID: "C", Tokens: seqTokens(200, 8)})
	var outs []Output
	for range 2 { // A's prefill; A's decode with B's and C's prefill
		at, _ := e.NextEventTime()
		outs = append(outs, e.Advance(at)...)
	}
	if st := e.Stats(); st.Running != 3 || st.FreeBlocks != 0 || len(outs) != 3 {
		t.Fatalf("before the shortage: %+v, outputs %+v", st, outs)
	}
	at, _ := e.NextEventTime() // the shortage: A preempted at the step's start
	pre, ok := find(e.TakeOutputs(), "A", Preempted)
	if !ok || pre.OutputTokens != 2 {
		t.Fatalf("A not preempted at the step's start with 2 tokens (%+v)", pre)
	}
	before := e.Stats().OutputTokens
	for _, o := range e.Advance(at) {
		if o.RequestID == "A" {
			t.Errorf("A produced %v in the step it was taken out of", o)
		}
	}
	if st := e.Stats(); st.OutputTokens != before+2 {
		t.Errorf("the step sampled %d tokens, want B's and C's", st.OutputTokens-before)
	}
	if st := e.Stats(); st.Running != 2 || st.Waiting != 1 || st.Preemptions != 1 {
		t.Errorf("after the step: %+v, want B and C running, A waiting", st)
	}
	outs = runIdle(t, e)
	if f, ok := find(outs, "A", Finished); !ok || f.OutputTokens != 4 {
		t.Errorf("A's finish %+v", f)
	}
	if st := e.Stats(); st.Finished != 3 || st.UsedBlocks != 0 {
		t.Errorf("stats %+v", st)
	}
}
