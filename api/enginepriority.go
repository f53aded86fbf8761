package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"

	"github.com/kvrouter/kvrouter/api/tenant"
)

// Tenant engine priority (kvrouter serve --tenant-engine-priority,
// TenantConfig.EnginePriority). The admission queue orders what a replica
// releases, but a worker serves what it was given in its own order: an
// over-share tenant's backlog already inside a worker's waiting queue (and
// its full running set) delays an under-share tenant's request however
// early the queue released it. vLLM (--scheduling-policy priority) and
// SGLang (--enable-priority-scheduling, with
// --schedule-low-priority-values-first: without it SGLang serves higher
// values first) order their waiting queue by a request field, "priority",
// lower first; with this setting the proxy sets
// that field on every request it forwards, from the tenant ledger at the
// moment it is sent (each attempt):
//
//	priority = level·2³² − soft
//
// level is tenant.Ledger.EnginePriority (0 while the tenant is not over its
// share, 1 while it is and another tenant is active); soft is the request's
// nvext.agent_hints.priority after the key's cap (Dynamo's soft priority,
// higher more urgent, an int32). The level dominates: across tenants the
// ledger decides, as in the admission queue; within a level, the client's
// hint orders, as it orders a tenant's requests in the queue. Soft 0 gives
// the bare level (0 or 1). The strict tier (strict_priority) is not carried
// (the admission queue already releases higher tiers first). A "priority"
// member the client sent is replaced: the router owns the field.
//
// The workers must run a priority policy: vLLM refuses a non-zero priority
// otherwise ("Priority scheduling is not enabled").
const enginePriorityBand = 1 << 32

// enginePriority is the value a request carries to its worker.
func enginePriority(level, soft int) int64 {
	return int64(level)*enginePriorityBand - int64(soft)
}

// withEnginePriority returns body, sent for p, with its priority set, when
// the setting is on; else body itself.
func (s *Server) withEnginePriority(p *prepared, body []byte) []byte {
	if s.tenants == nil || !s.tenants.Config().EnginePriority {
		return body
	}
	prio := enginePriority(s.tenants.EnginePriority(p.model, p.tenant), p.req.Priority)
	out, err := setPriority(body, prio)
	if err != nil {
		// Not reached: the body was parsed as a JSON object before routing.
		s.log.Warn("engine priority not set", "request", p.req.ID, "err", err)
		return body
	}
	return out
}

// Engine priority levels, re-exported for the tests and docs.
const (
	engineAtShare   = tenant.EngineAtShare
	engineOverShare = tenant.EngineOverShare
)

// setPriority returns the JSON object body with its top-level "priority"
// member set to prio: every such member's value replaced in place (a
// duplicated key keeps no stale value, whichever the engine's parser
// keeps), or, when there is none, the member inserted first. The rest of
// the body is kept byte for byte. An error when body is not one JSON
// object.
func setPriority(body []byte, prio int64) ([]byte, error) {
	val := strconv.AppendInt(nil, prio, 10)
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	tok, err := dec.Token()
	if err != nil {
		return nil, fmt.Errorf("engine priority: %w", err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return nil, errors.New("engine priority: the body is not a JSON object")
	}
	open := int(dec.InputOffset()) // just past '{'
	type span struct{ from, to int }
	var found []span
	for dec.More() {
		key, err := dec.Token()
		if err != nil {
			return nil, fmt.Errorf("engine priority: %w", err)
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, fmt.Errorf("engine priority: %w", err)
		}
		if key == "priority" {
			end := int(dec.InputOffset())
			found = append(found, span{end - len(raw), end})
		}
	}
	if tok, err = dec.Token(); err != nil {
		return nil, fmt.Errorf("engine priority: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("engine priority: data after the JSON object")
	}
	if len(found) == 0 {
		out := make([]byte, 0, len(body)+len(val)+12)
		out = append(out, body[:open]...)
		out = append(out, `"priority":`...)
		out = append(out, val...)
		if bytes.TrimSpace(body[open:])[0] != '}' {
			out = append(out, ',')
		}
		return append(out, body[open:]...), nil
	}
	out := make([]byte, 0, len(body)+len(found)*len(val))
	at := 0
	for _, f := range found {
		out = append(out, body[at:f.from]...)
		out = append(out, val...)
		at = f.to
	}
	return append(out, body[at:]...), nil
}
