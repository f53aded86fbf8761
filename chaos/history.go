package chaos

import (
	"fmt"
	"math"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"
)

// --- admin clients and the linearizability check ---------------------------------

// adminOp is one /busy_threshold operation on the ledger model's decode
// threshold, a register: writes set a unique value (k/1e6), reads return
// the current one (-1 = null).
type adminOp struct {
	Client  int    `json:"client"`
	Replica string `json:"replica"`
	Write   bool   `json:"write"`
	Value   int64  `json:"value"` // written, or read
	Call    int64  `json:"call"`  // ns since the history's start
	Return  int64  `json:"return"`
	OK      bool   `json:"ok"`
	Err     string `json:"err,omitempty"`
}

type adminHistory struct {
	mu    sync.Mutex
	start time.Time
	ops   []adminOp
}

func (h *adminHistory) add(op adminOp) {
	h.mu.Lock()
	h.ops = append(h.ops, op)
	h.mu.Unlock()
}

func (h *adminHistory) since(t time.Time) int64 { return int64(t.Sub(h.start)) }

// notApplied says whether a failed write certainly did not take effect,
// by the API's error contract: the connection was refused, the request was
// refused (4xx), or the cluster said "no leader" (cluster.ErrNoLeader: not
// applied) rather than "outcome unknown". Such writes are left out of the
// history; if one did take effect after all, a read of its value makes the
// history Illegal, so the contract is checked too. Everything else
// (timeouts, resets, "outcome unknown", shutdown) stays pending.
func notApplied(err string) bool {
	switch {
	case strings.Contains(err, "connection refused"):
		return true
	case strings.HasPrefix(err, "HTTP 4"):
		return true
	case strings.HasPrefix(err, "HTTP 503") && strings.Contains(err, "no leader") && !strings.Contains(err, "outcome unknown"):
		return true
	}
	return false
}

// unknownWriteBound is how long after its call a write whose outcome is
// unknown may still take effect (see checkLinearizable).
const unknownWriteBound = 15 * time.Second

type regInput struct {
	Write bool
	Value int64
}

var registerModel = porcupine.Model{
	Init: func() any { return int64(-1) },
	Step: func(state, input, output any) (bool, any) {
		in := input.(regInput)
		if in.Write {
			return true, in.Value
		}
		return output.(int64) == state.(int64), state
	},
	DescribeOperation: func(input, output any) string {
		in := input.(regInput)
		if in.Write {
			return fmt.Sprintf("write(%d)", in.Value)
		}
		return fmt.Sprintf("read() → %d", output.(int64))
	},
	DescribeState: func(state any) string { return fmt.Sprint(state.(int64)) },
}

// linearizabilityResult is the porcupine verdict over the history:
// successful reads, successful writes, and failed writes (their outcome is
// unknown: pending until the end). Failed reads have no effect and are
// left out.
type linearizabilityResult struct {
	Result      string      `json:"result"`
	Ops         int         `json:"ops"`
	Reads       int         `json:"reads"`
	Writes      int         `json:"writes"`
	Unknown     int         `json:"unknown_writes"`
	NotApplied  int         `json:"failed_writes_not_applied"`
	FailedReads int         `json:"failed_reads"`
	Visual      string      `json:"visualization,omitempty"`
	StaleReads  *staleStats `json:"stale_reads,omitempty"`
	// ReadsOfRefused: reads that returned a value whose write had failed
	// with a "not applied" error: the error contract is broken.
	ReadsOfRefused []string `json:"reads_of_refused_writes,omitempty"`
	// ReadsOfUnwritten: reads of a value nobody wrote (corruption, or a
	// writer outside the history).
	ReadsOfUnwritten []string `json:"reads_of_unwritten_values,omitempty"`
}

func checkLinearizable(h *adminHistory, timeout time.Duration, visualPath string) linearizabilityResult {
	h.mu.Lock()
	ops := append([]adminOp(nil), h.ops...)
	h.mu.Unlock()
	var hist []porcupine.Operation
	res := linearizabilityResult{}
	for _, op := range ops {
		switch {
		case op.Write && op.OK:
			res.Writes++
		case op.Write && notApplied(op.Err):
			res.NotApplied++
			continue
		case op.Write:
			// Outcome unknown: it may take effect at any time after its
			// call, but not forever: the replica gives a proposal 5 s
			// (propose) plus forwarding; an entry not committed by the
			// next leader's first commit never will be. 15 s after the
			// call bounds it and keeps the search tractable.
			res.Unknown++
			op.Return = min(op.Call+int64(unknownWriteBound), math.MaxInt64)
		case op.OK:
			res.Reads++
		default:
			res.FailedReads++
			continue
		}
		hist = append(hist, porcupine.Operation{ClientId: op.Client, Input: regInput{Write: op.Write, Value: op.Value},
			Call: op.Call, Output: op.Value, Return: op.Return, Metadata: op.Replica})
	}
	res.Ops = len(hist)
	refused := map[int64]string{}
	for _, op := range ops {
		if op.Write && !op.OK && notApplied(op.Err) {
			refused[op.Value] = op.Err
		}
	}
	written := map[int64]bool{-1: true}
	for _, op := range ops {
		if op.Write {
			written[op.Value] = true
		}
	}
	for _, op := range ops {
		if !op.Write && op.OK && !written[op.Value] && len(res.ReadsOfUnwritten) < 10 {
			res.ReadsOfUnwritten = append(res.ReadsOfUnwritten, fmt.Sprintf("client %d read %d from %s at +%.3fs, a value no client wrote",
				op.Client, op.Value, op.Replica, float64(op.Call)/1e9))
		}
		if why, ok := refused[op.Value]; ok && !op.Write && op.OK && len(res.ReadsOfRefused) < 10 {
			res.ReadsOfRefused = append(res.ReadsOfRefused, fmt.Sprintf("client %d read %d from %s at +%.3fs, a write that failed with %q",
				op.Client, op.Value, op.Replica, float64(op.Call)/1e9, firstN(why, 120)))
		}
	}
	verdict, info := porcupine.CheckOperationsVerbose(registerModel, hist, timeout)
	res.Result = string(verdict)
	if verdict != porcupine.Ok && visualPath != "" {
		f, err := os.Create(visualPath)
		if err == nil {
			if err := porcupine.Visualize(registerModel, info, f); err == nil {
				res.Visual = visualPath
			}
			f.Close()
		}
	}
	if verdict == porcupine.Illegal {
		st := staleReads(ops)
		res.StaleReads = &st
	}
	return res
}

// staleReads finds simple evidence for an Illegal verdict: a successful
// read returning value v although a write W of another value completed
// before the read began and the write of v had itself completed before W
// began (so v was already overwritten; -1, the initial null, counts as
// written before everything). Writes of unknown outcome never make a read
// stale. It is a hint for the report; porcupine gives the verdict.
func staleReads(ops []adminOp) staleStats {
	st := staleStats{ByReplica: map[string]int{}}
	type w struct{ call, ret, v int64 }
	var writes []w
	byValue := map[int64]w{-1: {call: math.MinInt64, ret: math.MinInt64, v: -1}}
	unknown := map[int64]bool{}
	for _, op := range ops {
		switch {
		case op.Write && op.OK:
			writes = append(writes, w{op.Call, op.Return, op.Value})
			byValue[op.Value] = w{op.Call, op.Return, op.Value}
		case op.Write:
			unknown[op.Value] = true
		}
	}
	sort.Slice(writes, func(i, j int) bool { return writes[i].ret < writes[j].ret })
	for _, op := range ops {
		if op.Write || !op.OK || unknown[op.Value] {
			continue
		}
		src, ok := byValue[op.Value]
		if !ok {
			continue
		}
		// The earliest overwrite: how long the read's value had been stale.
		for _, x := range writes {
			if x.ret < op.Call && x.v != op.Value && src.ret < x.call {
				st.Count++
				st.ByReplica[op.Replica]++
				lag := float64(op.Call-x.ret) / 1e6
				st.MaxLagMs = math.Max(st.MaxLagMs, lag)
				if len(st.Examples) < 10 {
					st.Examples = append(st.Examples, fmt.Sprintf("client %d read %d from %s at +%.3fs; write %d had completed at +%.3fs (%.0f ms before)",
						op.Client, op.Value, op.Replica, float64(op.Call)/1e9, x.v, float64(x.ret)/1e9, lag))
				}
				break
			}
		}
	}
	return st
}

// staleStats summarises the stale reads staleReads finds.
type staleStats struct {
	Count     int            `json:"count"`
	ByReplica map[string]int `json:"by_replica"`
	MaxLagMs  float64        `json:"max_lag_ms"` // the stalest read: ms since its value was overwritten
	Examples  []string       `json:"examples,omitempty"`
}

func firstN(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}
