//! Two setups measured side by side in one run, in alternating rounds (A then B, then B
//! then A, …): when the machine's speed drifts (other work starts or stops) both sides
//! see the drift alike, and the median of the rounds' ratios is not moved by one slow or
//! one lucky round.

use std::future::Future;

/// `rounds` pairs `(a, b)`, measured in alternating order.
pub async fn rounds<T, E, F, Fut>(rounds: usize, mut measure: F) -> Result<Vec<(T, T)>, E>
where
    F: FnMut(Side) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut pairs = Vec::with_capacity(rounds.max(1));
    for round in 0..rounds.max(1) {
        let pair = if round % 2 == 0 {
            let a = measure(Side::A).await?;
            (a, measure(Side::B).await?)
        } else {
            let b = measure(Side::B).await?;
            (measure(Side::A).await?, b)
        };
        pairs.push(pair);
    }
    Ok(pairs)
}

/// Which of the two setups a measurement is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    A,
    B,
}

/// The median (the upper one of an even count); 0 for none.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Each round's ratio `f(a) / f(b)`, and their median.
pub fn ratios<T>(pairs: &[(T, T)], f: impl Fn(&T) -> f64) -> (Vec<f64>, f64) {
    let each: Vec<f64> = pairs.iter().map(|(a, b)| f(a) / f(b).max(1e-9)).collect();
    (each.clone(), median(each))
}

/// Ratios as the report shows them: `1.032× (median of 1.051×, 1.032×, 0.987×)`.
pub fn shown(each: &[f64], median: f64) -> String {
    let list: Vec<String> = each.iter().map(|r| format!("{r:.3}×")).collect();
    format!("{median:.3}× median of rounds {}", list.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_ratios() {
        assert_eq!(median(vec![]), 0.0);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        let pairs = [(2.0, 1.0), (3.0, 3.0), (10.0, 2.0)];
        let (each, m) = ratios(&pairs, |v| *v);
        assert_eq!(each, vec![2.0, 1.0, 5.0]);
        assert_eq!(m, 2.0);
    }

    #[test]
    fn rounds_alternate() {
        let order = std::cell::RefCell::new(Vec::new());
        let pairs = block_on(rounds(3, |side| {
            order.borrow_mut().push(side);
            let v = if side == Side::A { 1 } else { 2 };
            async move { Ok::<_, ()>(v) }
        }))
        .unwrap();
        assert_eq!(pairs, vec![(1, 2), (1, 2), (1, 2)]);
        use Side::{A, B};
        assert_eq!(*order.borrow(), vec![A, B, B, A, A, B]);
    }

    fn block_on<F: Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
            .block_on(f)
    }
}
