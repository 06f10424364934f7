// The pull-query client of `make bench`'s serve group (bench/serving.py), in Go so that the
// client's own pauses (an interpreter lock, a collector) stay out of the replica's figures.
//
// Point lookups of random keys over -connections keep-alive HTTP connections, at a fixed
// -rate (requests/s) or without pause (-rate 0), for -seconds. Request n is due at
// start + n/rate and is taken by the next free connection; its latency counts from when it
// was due (an open loop: a slow answer does not hold back the requests after it, and their
// wait counts), its service time from when it was sent. Anything but a 200, or no answer
// within -timeout, is an error. It writes what it measured as JSON to -out, in the format of
// bench/pull_client.py (the client it replaced; see docs/decisions/0036-serving-replicas.md).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strings"
	"sync"
	"time"
)

type schedule struct {
	mu    sync.Mutex
	rate  float64
	start time.Time
	end   time.Time
	next  int64
}

// take says when the next request is due, and false once the run is over.
func (s *schedule) take() (time.Time, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	due := time.Now()
	if s.rate > 0 {
		due = s.start.Add(time.Duration(float64(s.next) / s.rate * float64(time.Second)))
	}
	if !due.Before(s.end) {
		return due, false
	}
	s.next++
	return due, true
}

type worker struct {
	latencies  []float64
	services   []float64
	statuses   map[string]int
	errors     int
	firstError string
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func main() {
	target := flag.String("url", "", "the replica, http://host:port")
	pipeline := flag.String("pipeline", "", "the pipeline")
	keys := flag.Int("keys", 0, "keys product-000000 onwards")
	keyFormat := flag.String("key-format", "product-%06d", "a key from its number")
	rate := flag.Float64("rate", 1000, "requests/s; 0: no pause")
	seconds := flag.Float64("seconds", 30, "seconds to run")
	connections := flag.Int("connections", 4, "keep-alive connections")
	timeout := flag.Float64("timeout", 5, "seconds an answer may take")
	seed := flag.Int64("seed", 1, "seed of the keys asked for")
	out := flag.String("out", "", "where the JSON goes")
	flag.Parse()
	if *target == "" || *pipeline == "" || *keys < 1 || *out == "" {
		fmt.Fprintln(os.Stderr, "-url, -pipeline, -keys (at least 1) and -out are required")
		os.Exit(2)
	}
	prefix := strings.TrimRight(*target, "/") + "/v1/pipelines/" + url.PathEscape(*pipeline) + "/rows/"
	client := &http.Client{
		Timeout: time.Duration(*timeout * float64(time.Second)),
		Transport: &http.Transport{
			MaxIdleConnsPerHost: *connections,
			MaxConnsPerHost:     *connections,
			DisableCompression:  true,
		},
	}
	start := time.Now()
	plan := &schedule{rate: *rate, start: start, end: start.Add(time.Duration(*seconds * float64(time.Second)))}
	workers := make([]*worker, *connections)
	var wg sync.WaitGroup
	for n := range workers {
		w := &worker{statuses: map[string]int{}}
		workers[n] = w
		random := rand.New(rand.NewSource(*seed*1000 + int64(n)))
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				due, ok := plan.take()
				if !ok {
					return
				}
				if pause := time.Until(due); pause > 0 {
					time.Sleep(pause)
				}
				key := fmt.Sprintf(*keyFormat, random.Intn(*keys))
				sent := time.Now()
				status := ""
				answer, err := client.Get(prefix + url.PathEscape(key))
				if err != nil {
					status = "error"
				} else {
					_, _ = io.Copy(io.Discard, answer.Body)
					answer.Body.Close()
					status = fmt.Sprint(answer.StatusCode)
				}
				answered := time.Now()
				w.latencies = append(w.latencies, ms(answered.Sub(due)))
				w.services = append(w.services, ms(answered.Sub(sent)))
				w.statuses[status]++
				if status != "200" {
					w.errors++
					if w.firstError == "" {
						w.firstError = key + ": " + status
						if err != nil {
							w.firstError += " " + err.Error()
						}
					}
				}
			}
		}()
	}
	wg.Wait()
	result := map[string]any{
		"seconds": time.Since(start).Seconds(), "rate": *rate, "connections": *connections,
	}
	var latencies, services []float64
	statuses := map[string]int{}
	errors, firstError := 0, ""
	for _, w := range workers {
		latencies = append(latencies, w.latencies...)
		services = append(services, w.services...)
		for status, count := range w.statuses {
			statuses[status] += count
		}
		errors += w.errors
		if firstError == "" {
			firstError = w.firstError
		}
	}
	sort.Float64s(latencies)
	sort.Float64s(services)
	result["requests"], result["errors"], result["first_error"] = len(latencies), errors, firstError
	result["statuses"], result["latencies_ms"], result["services_ms"] = statuses, latencies, services
	data, err := json.Marshal(result)
	if err == nil {
		err = os.WriteFile(*out, data, 0o644)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
