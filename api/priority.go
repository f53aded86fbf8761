package api

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Dynamo's request priority, as its frontend reads it (docs: "Priority
// Scheduling", "NVIDIA Request Extensions"):
//   - nvext.agent_hints.priority, an i32: soft priority. Here it orders
//     requests within a tenant of a class (router.Queue), as it did before
//     classes existed; Dynamo turns it into an arrival-time bump instead.
//   - nvext.agent_hints.strict_priority, a u32: the pending-queue tier.
//     Higher tiers always precede lower ones (router.Waiting.Class).
//   - x-dynamo-request-priority and x-dynamo-request-strict-priority: the
//     same values as headers, which override the body's.
//
// A value of the wrong type or out of its range is a 400 naming the field,
// as Dynamo's typed parse refuses it; null or absent is unset (0).
const (
	headerRequestPriority       = "X-Dynamo-Request-Priority"
	headerRequestStrictPriority = "X-Dynamo-Request-Strict-Priority"
)

// requestPriority is a request's two priorities, before the caller's cap.
type requestPriority struct {
	Soft   int    // nvext.agent_hints.priority
	Strict uint32 // nvext.agent_hints.strict_priority
}

// agentHintPriorities are the raw body fields, read by inferenceRequest.
type agentHintPriorities struct {
	Priority       json.RawMessage `json:"priority"`
	StrictPriority json.RawMessage `json:"strict_priority"`
}

// readPriority reads a request's priorities from its agent hints and
// headers (the headers win).
func readPriority(h http.Header, hints agentHintPriorities) (requestPriority, error) {
	var p requestPriority
	soft, err := priorityValue("nvext.agent_hints.priority", hints.Priority, math.MinInt32, math.MaxInt32)
	if err != nil {
		return p, err
	}
	strict, err := priorityValue("nvext.agent_hints.strict_priority", hints.StrictPriority, 0, math.MaxUint32)
	if err != nil {
		return p, err
	}
	if v, ok, err := priorityHeader(h, headerRequestPriority, math.MinInt32, math.MaxInt32); err != nil {
		return p, err
	} else if ok {
		soft = v
	}
	if v, ok, err := priorityHeader(h, headerRequestStrictPriority, 0, math.MaxUint32); err != nil {
		return p, err
	} else if ok {
		strict = v
	}
	return requestPriority{Soft: int(soft), Strict: uint32(strict)}, nil
}

// priorityValue parses one body field: an integer in [lo, hi]; absent or
// null is 0. JSON numbers such as 3.0 or 1e2 are integers too.
func priorityValue(name string, raw json.RawMessage, lo, hi int64) (int64, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return 0, nil
	}
	var f float64
	if err := json.Unmarshal(raw, &f); err != nil {
		return 0, fmt.Errorf("%s must be an integer in [%d, %d], got %s", name, lo, hi, clip(string(raw)))
	}
	if f != math.Trunc(f) || f < float64(lo) || f > float64(hi) {
		return 0, fmt.Errorf("%s must be an integer in [%d, %d], got %s", name, lo, hi, clip(string(raw)))
	}
	return int64(f), nil
}

// priorityHeader parses one header: a decimal integer in [lo, hi]; ok is
// false when the header is absent or empty.
func priorityHeader(h http.Header, name string, lo, hi int64) (int64, bool, error) {
	s := strings.TrimSpace(h.Get(name))
	if s == "" {
		return 0, false, nil
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || v < lo || v > hi {
		return 0, false, fmt.Errorf("header %s must be an integer in [%d, %d], got %q", name, lo, hi, clip(s))
	}
	return v, true, nil
}

// MaxLatencySensitivity bounds nvext.agent_hints.latency_sensitivity. Dynamo
// sets no bound; one hour is far past any queue wait (a request waiting an
// hour has long been cut by its client), and it keeps the arrival shift
// well inside time.Duration.
const MaxLatencySensitivity = time.Hour

// readLatencySensitivity parses nvext.agent_hints.latency_sensitivity, a
// number of seconds (Dynamo's f64): absent or null is 0. A value of another
// type is a 400 naming the field, as Dynamo's typed parse refuses the
// request; so is a negative one (Dynamo would take it and move the request
// later, which no client means) or one over MaxLatencySensitivity. JSON has
// no NaN or infinity, so a finite number is all that can arrive.
func readLatencySensitivity(raw json.RawMessage) (time.Duration, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return 0, nil
	}
	var f float64
	if err := json.Unmarshal(raw, &f); err != nil || f < 0 || f > MaxLatencySensitivity.Seconds() {
		return 0, fmt.Errorf("nvext.agent_hints.latency_sensitivity must be a number of seconds in [0, %g], got %s",
			MaxLatencySensitivity.Seconds(), clip(string(raw)))
	}
	return time.Duration(f * float64(time.Second)), nil
}

// clip shortens a client's value for an error message.
func clip(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}
